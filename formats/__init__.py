"""First-party format adapters, imported as ``ckpttool.formats``.

One module per format; each exposes an ``ADAPTER`` object that follows
:class:`ckpttool.formats.base.Adapter`.
"""
