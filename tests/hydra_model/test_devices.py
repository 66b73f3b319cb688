"""Where a model computes, checked before any tensor is made; bfloat16 by default on a
GPU; results brought to the host in one wait. (The GPU's own behaviour: `tests/gpu`.)"""

from __future__ import annotations

import pytest
import torch

from hydra_jury.cli import main
from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.model import default_dtype, resolve_device
from hydra_jury.workers.calls import HiddenStates, ScoreResult, to_host

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("name", ["tpu", "mps", "meta", "cuda:x", ""])
def test_an_unknown_device_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"device '{name}': expected cpu, cuda or cuda:N"):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_says_so(name, jury_checkpoint):
    with pytest.raises(ValueError, match=f"device '{name}': this PyTorch .* sees no CUDA"):
        HydraModel.load(jury_checkpoint, device=name)


@no_cuda
def test_the_cli_refuses_cuda_without_a_gpu(jury_checkpoint, capsys):
    argv = ["generate", "--local", "--checkpoint", str(jury_checkpoint), "--device", "cuda"]
    assert main([*argv, "hi"]) == 2
    assert "device 'cuda': this PyTorch" in capsys.readouterr().err


def test_bfloat16_by_default_on_a_gpu_and_the_checkpoints_dtype_on_a_cpu():
    assert default_dtype(torch.device("cuda", 0), "float32") == "bfloat16"
    assert default_dtype(torch.device("cpu"), "float32") == "float32"
    assert default_dtype(torch.device("cpu"), "bfloat16") == "bfloat16"
    assert resolve_device("cpu") == torch.device("cpu")


def test_host_results_are_not_copied():
    tensors = [torch.ones(2), torch.zeros(3, dtype=torch.long)]
    assert to_host(tensors) is tensors
    hidden = HiddenStates(1, torch.ones(1, 4))
    assert hidden.on_host().payload is hidden.payload
    result = ScoreResult(torch.zeros(2, 5), None, torch.zeros(2, 1, dtype=torch.long), ("a",))
    assert result.on_host() is result
