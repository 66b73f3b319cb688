"""A `train-heads` run's files in `OUT/.train/`, which make it resumable.

- `hidden.safetensors`: every shard's windows of token ids and the trunk's outputs for
  them (the heads' inputs), computed once per run.
- `examples.safetensors` (`--uncertainty`): the graded answers to the multiple-choice
  questions with the uncertainty head's input for each, answered once per run.
- `state.safetensors`: the trained tensors, the optimizer's state and, as metadata, the
  run's settings, the steps done and the loss of every step. Written to a temporary file
  and renamed, so an interrupted save leaves the previous state whole.

Both record the run's settings; a run resumes only from files of the same settings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STATE_DIR = ".train"
HIDDEN_FILE = "hidden.safetensors"
EXAMPLES_FILE = "examples.safetensors"
STATE_FILE = "state.safetensors"


def state_dir(out: Path) -> Path:
    return out / STATE_DIR


def save_hidden(
    out: Path, settings: dict[str, Any], windows: list[torch.Tensor], hidden: list[torch.Tensor]
) -> None:
    tensors = {f"windows.{i}": w for i, w in enumerate(windows)}
    tensors.update({f"hidden.{i}": h for i, h in enumerate(hidden)})
    _save_atomically(tensors, {"settings": settings}, state_dir(out) / HIDDEN_FILE)


def load_hidden(
    out: Path, settings: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(windows, hidden states) per shard, or None when absent or of other settings."""
    loaded = _load(state_dir(out) / HIDDEN_FILE)
    if loaded is None or loaded[1].get("settings") != settings:
        return None
    tensors = loaded[0]
    shards = len(settings["heads"])
    return [tensors[f"windows.{i}"] for i in range(shards)], [
        tensors[f"hidden.{i}"] for i in range(shards)
    ]


def save_examples(
    out: Path, settings: dict[str, Any], inputs: list[torch.Tensor], records: list[dict]
) -> None:
    """Each example's input tensor, and as metadata what else it is (JSON records)."""
    tensors = {f"input.{i}": t for i, t in enumerate(inputs)}
    run = {"settings": settings, "examples": records}
    _save_atomically(tensors, run, state_dir(out) / EXAMPLES_FILE)


def load_examples(
    out: Path, settings: dict[str, Any]
) -> tuple[list[torch.Tensor], list[dict]] | None:
    """(inputs, records) as saved, or None when absent or of other settings."""
    loaded = _load(state_dir(out) / EXAMPLES_FILE)
    if loaded is None or loaded[1].get("settings") != settings:
        return None
    tensors, run = loaded
    return [tensors[f"input.{i}"] for i in range(len(run["examples"]))], run["examples"]


def saved_settings(out: Path) -> dict[str, Any] | None:
    """The settings of the run whose state is in `out`, or None when there is none."""
    path = state_dir(out) / STATE_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()["run"])["settings"]


def save_state(
    out: Path,
    settings: dict[str, Any],
    parameters: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    losses: list[list[float]],
) -> None:
    tensors = {f"param/{name}": t.detach() for name, t in parameters.items()}
    state = optimizer.state_dict()["state"]
    for index, name in enumerate(parameters):
        for key, value in state.get(index, {}).items():
            tensors[f"optimizer/{name}/{key}"] = value
    run = {"settings": settings, "step": len(losses), "losses": losses}
    _save_atomically(tensors, run, state_dir(out) / STATE_FILE)


def load_state(
    out: Path, parameters: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[list[float]]:
    """Restores the parameters (in place) and the optimizer; returns the losses so far."""
    tensors, run = _load(state_dir(out) / STATE_FILE)
    with torch.no_grad():
        for name, tensor in parameters.items():
            tensor.copy_(tensors[f"param/{name}"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(parameters):
        prefix = f"optimizer/{name}/"
        entries = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        if entries:
            state[index] = entries
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return run["losses"]


def _save_atomically(tensors: dict[str, torch.Tensor], run: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(partial), metadata={"run": json.dumps(run)})
    os.replace(partial, path)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        run = json.loads(handle.metadata()["run"])
        return {name: handle.get_tensor(name) for name in handle.keys()}, run
