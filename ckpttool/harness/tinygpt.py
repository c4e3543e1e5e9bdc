"""The reference harness: a tiny GPT with dropout, AdamW, warmup + cosine LR, a seeded data loader
with a resumable cursor, and CPU (and CUDA) RNG; saves its full state with ``dcp.save``.

    python -m ckpttool.harness.tinygpt train --out DIR --steps 30 --save-every 10 [--omit rng]

writes ``DIR/step_10/``, ``DIR/step_20/``, ... (``--layout rankshards``: a per-rank
``shard_00000_of_00001.pt`` in each instead of DCP files) and, beside each checkpoint (inside its directory),
``ckpttool.trajectory.json`` (the next K steps' losses and state digests of the uninterrupted run)
and ``ckpttool.trajectory.pt`` (that run's component states at the save, for blame). ``--omit``
leaves one component out of the checkpoint, to show what ``ckpttool rehearse`` detects.
``factory()`` is what ``rehearse --harness ckpttool.harness.tinygpt:factory`` calls.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ckpttool.harness import COMPONENTS, TRAJECTORY, TRAJECTORY_STATES

VOCAB, DIM, SEQ, BATCH, SAMPLES = 128, 64, 32, 16, 512
WARMUP, TOTAL = 5, 60
_KEYS = {"optimizer": "optim", "scheduler": "scheduler", "rng": "rng", "dataloader": "dataloader"}
SHARD = "shard_00000_of_00001.pt"


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.block = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.1, batch_first=True)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.mask: torch.Tensor
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos[:n]
        h = self.block(h, src_mask=self.mask[:n, :n])
        return self.head(self.ln(h))


class SeededLoader:
    """Batches of a fixed synthetic corpus in a per-epoch shuffled order; its position is a state."""

    def __init__(self, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=gen)
        self.seed, self.epoch, self.cursor = seed, 0, 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next(self) -> torch.Tensor:
        if self.cursor + BATCH > SAMPLES:
            self.epoch, self.cursor = self.epoch + 1, 0
        idx = self._order()[self.cursor : self.cursor + BATCH]
        self.cursor += BATCH
        return self.data[idx]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])


def _lr(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


def _digest(*tensors: torch.Tensor) -> str:
    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _json_digest(obj: Any) -> str:
    return xxhash.xxh3_128(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


class TinyGPTHarness:
    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        torch.manual_seed(0)
        self.model = TinyGPT().to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr)
        self.loader = SeededLoader()

    # -- training -----------------------------------------------------------------------------------

    def step(self) -> float:
        batch = self.loader.next().to(self.device)
        self.model.train()
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def state(self, omit: str | None = None) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optim": get_optimizer_state_dict(self.model, self.opt),
            "scheduler": self.sched.state_dict(),
            "rng": self._rng(),
            "dataloader": self.loader.state_dict(),
            "step": int(self.sched.last_epoch),
        }
        if omit:
            sd.pop(_KEYS[omit])
        return sd

    def _rng(self) -> dict[str, torch.Tensor]:
        out = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    # -- the harness protocol -----------------------------------------------------------------------

    def restore(self, path: str) -> dict[str, bool]:
        template = self.state()
        shard = Path(path) / SHARD
        if shard.is_file():  # the per-rank layout: one torch.save file per rank (one rank here)
            saved = torch.load(shard, weights_only=True)
            keys = set(_flatten_keys(saved))
            wanted = {k: v for k, v in saved.items() if k in template}
        else:
            from torch.distributed.checkpoint import FileSystemReader

            keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
            roots = {k.split(".", 1)[0] for k in keys}
            wanted = {k: v for k, v in template.items() if k in roots}
        missing = sorted(k for k in _flatten_keys({"model": template["model"]}) if k not in keys)
        if missing:
            raise KeyError(
                f"checkpoint {path} has no parameter {missing[0]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        if not shard.is_file():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(wanted, checkpoint_id=path)
        self.model.load_state_dict(wanted["model"])
        restored = {"model": True, "optimizer": False, "scheduler": False, "rng": False, "dataloader": False}
        if "optim" in wanted:
            set_optimizer_state_dict(self.model, self.opt, wanted["optim"])
            restored["optimizer"] = True
        if "scheduler" in wanted:
            self.sched.load_state_dict(wanted["scheduler"])
            restored["scheduler"] = True
        if "dataloader" in wanted:
            self.loader.load_state_dict(wanted["dataloader"])
            restored["dataloader"] = True
        if "rng" in wanted:
            torch.set_rng_state(wanted["rng"]["torch_cpu"])
            if torch.cuda.is_available() and "cuda" in wanted["rng"]:
                torch.cuda.set_rng_state(wanted["rng"]["cuda"])
            restored["rng"] = True
        return restored

    def digests(self) -> dict[str, str]:
        moments = [t for st in self.opt.state.values() for k, t in sorted(st.items()) if torch.is_tensor(t)]
        return {
            "model": _digest(*self.model.parameters()),
            "optimizer": _digest(*moments) if moments else "no-state",
            "scheduler": _json_digest(self.sched.state_dict()),
            "rng": _digest(*self._rng().values()),
            "dataloader": _json_digest(self.loader.state_dict()),
        }

    def capture(self, component: str) -> Any:
        if component == "model":
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if component == "optimizer":
            return copy.deepcopy(self.opt.state_dict())
        if component == "scheduler":
            return copy.deepcopy(self.sched.state_dict())
        if component == "rng":
            return {k: v.clone() for k, v in self._rng().items()}
        if component == "dataloader":
            return dict(self.loader.state_dict())
        raise KeyError(component)

    def force(self, component: str, state: Any) -> None:
        if component == "model":
            self.model.load_state_dict(state)
        elif component == "optimizer":
            self.opt.load_state_dict(state)
        elif component == "scheduler":
            self.sched.load_state_dict(state)
        elif component == "rng":
            torch.set_rng_state(state["torch_cpu"])
            if torch.cuda.is_available() and "cuda" in state:
                torch.cuda.set_rng_state(state["cuda"])
        elif component == "dataloader":
            self.loader.load_state_dict(state)
        else:
            raise KeyError(component)


def _flatten_keys(obj: Any, prefix: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [k for key, v in obj.items() for k in _flatten_keys(v, f"{prefix}.{key}" if prefix else str(key))]
    return [prefix]


def factory(device: str = "cpu") -> TinyGPTHarness:
    """What ``rehearse --harness ckpttool.harness.tinygpt:factory`` calls."""
    return TinyGPTHarness(device)


def train(
    out: Path, steps: int, save_every: int, k: int, omit: str | None, device: str, layout: str = "dcp"
) -> list[Path]:
    """Train, save every ``save_every`` steps, and record the next ``k`` steps after each save."""
    h = TinyGPTHarness(device)
    pending: list[dict[str, Any]] = []
    saved = []
    for step in range(1, steps + k + 1):
        loss = h.step()
        for p in pending:
            if len(p["steps"]) < k:
                p["steps"].append({"loss": loss.hex(), "digests": h.digests()})
        for p in [p for p in pending if len(p["steps"]) == k]:
            pending.remove(p)
            (p["dir"] / TRAJECTORY).write_text(
                json.dumps(
                    {"version": 1, "step": p["step"], "k": k, "components": p["components"], "steps": p["steps"]},
                    indent=1,
                )
            )
        if step <= steps and step % save_every == 0:
            target = out / f"step_{step}"
            if layout == "rankshards":
                target.mkdir(parents=True, exist_ok=True)
                torch.save(h.state(omit), target / SHARD)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.save(h.state(omit), checkpoint_id=target)
            torch.save({c: h.capture(c) for c in COMPONENTS}, target / TRAJECTORY_STATES)
            pending.append({"dir": target, "step": step, "components": h.digests(), "steps": []})
            saved.append(target)
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ckpttool.harness.tinygpt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train and save checkpoints with their trajectories")
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--save-every", type=int, default=10)
    t.add_argument("-k", "--record", type=int, default=5, help="steps recorded after each save")
    t.add_argument("--omit", choices=sorted(_KEYS), help="leave this state out of the checkpoints")
    t.add_argument("--device", default="cpu")
    t.add_argument(
        "--layout",
        choices=("dcp", "rankshards"),
        default="dcp",
        help="dcp.save, or one torch.save file per rank (shard_RRRRR_of_NNNNN.pt)",
    )
    args = ap.parse_args(argv)
    for p in train(args.out, args.steps, args.save_every, args.record, args.omit, args.device, args.layout):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
