"""A plain saved ExportedProgram for the CLI tests of this folder."""
from __future__ import annotations

from pathlib import Path

import torch


def plain_pt2(path: Path) -> Path:
    torch.manual_seed(0)
    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.randn(2, 4),))
    torch.export.save(ep, str(path))
    return path
