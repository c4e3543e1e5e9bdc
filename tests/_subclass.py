"""A tensor subclass defined at module level so torch.save can pickle it (by reference)."""

import torch


class MyTensor(torch.Tensor):
    pass
