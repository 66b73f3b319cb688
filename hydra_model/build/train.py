"""`hydra-jury train-heads`: each `llm` head of a Hydra checkpoint fine-tuned on its own
shard of a text corpus, the trunk frozen, written as a new checkpoint.

1. The corpus is split into one shard per head and packed into windows (`corpus`). The
   trunk runs once over every window; its outputs, the heads' inputs, are kept in the
   run's state (`train_state`) and reused by every step.
2. Each step takes `batch_size` windows per head, head h from shard h only, in a seeded
   order (a fresh permutation of the shard per pass), and runs every head at once through
   the runtime's head stack (`tuning`): next-token cross-entropy per head, summed (the
   heads share no weight, so each gets its own loss's gradient), each head's gradient
   clipped to norm 1, one AdamW step at a constant learning rate.
3. Every `save_every` steps the state is saved in `OUT/.train/`; the same command run
   again continues from there, exactly as an uninterrupted run would have gone on.
4. At the end `OUT` becomes a Hydra checkpoint: trunk and tokenizer files copied
   unchanged, each trained head in the checkpoint's dtype (LoRA merged by `lora`, the
   adapters kept in `OUT/adapters/<head>/`), other heads copied, the training recorded in
   `hydra.json` under "training".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hydra_jury.hydra_model.build.builder import save_tensors
from hydra_jury.hydra_model.build.corpus import (
    CorpusError,
    file_digest,
    pack_windows,
    read_corpus,
    shard_texts,
)
from hydra_jury.hydra_model.build.lora import lora_deltas, save_adapter
from hydra_jury.hydra_model.build.train_state import (
    load_hidden,
    load_state,
    save_hidden,
    save_state,
    saved_settings,
    state_dir,
)
from hydra_jury.hydra_model.build.tuning import TunedHeads
from hydra_jury.hydra_model.checkpoint import (
    DTYPES,
    HEADS_DIR,
    MANIFEST,
    Manifest,
    checkpoint_fingerprint,
    read_manifest,
    read_tensors,
)
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.model import HydraModel

ADAPTERS_DIR = "adapters"
CLIP_NORM = 1.0
HIDDEN_BATCH = 8  # windows per trunk forward while computing the heads' inputs
DEFAULT_LEARNING_RATE = {"full": 1e-4, "lora": 1e-3}
# No loss on the last position of a window: its next token is outside it.
IGNORED = -100

# on_step(step, steps, losses): after each step (1-based), each head's loss.
StepCallback = Callable[[int, int, list[float]], None]


class TrainError(ValueError):
    """Bad train-heads arguments; the message says what to change."""


@dataclass
class TrainOptions:
    checkpoint: str
    data: str
    out: str
    steps: int = 60
    lora_rank: int | None = None  # None: full fine-tuning
    learning_rate: float | None = None  # default: DEFAULT_LEARNING_RATE
    batch_size: int = 4  # windows per head and step
    seq_len: int = 128
    seed: int = 0
    save_every: int = 20
    force: bool = False  # start over, whatever `out` holds
    # An `out` this run cannot resume (finished, or of other settings) is replaced, not
    # refused; an unfinished run of the same settings still resumes (the demo build).
    replace_stale: bool = False
    questions: int = 320  # --uncertainty: multiple-choice questions written and answered

    @property
    def method(self) -> str:
        return "full" if self.lora_rank is None else "lora"

    @property
    def lr(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATE[self.method]


@dataclass
class TrainResult:
    out: Path
    heads: list[str]  # the trained heads, in the order of `losses`
    losses: list[list[float]]  # per step, per head
    resumed_at: int  # the step the run resumed from (0: a fresh run)
    seconds: float  # this invocation's wall time


def train_heads(
    options: TrainOptions,
    log: Callable[[str], None] = print,
    on_step: StepCallback | None = None,
) -> TrainResult:
    began = time.perf_counter()
    manifest = read_manifest(options.checkpoint)
    check_options(options, manifest)
    heads = [h.name for h in manifest.llm_heads]
    texts = read_corpus(options.data)
    if len(texts) < len(heads):
        raise CorpusError(
            f"{options.data}: {len(texts)} texts for {len(heads)} heads; every head needs a "
            "shard of its own, so the corpus needs at least one text per head"
        )
    settings = _settings(options, manifest, heads)
    out = Path(options.out)
    resuming = prepare_out(out, settings, options, log)

    model = HydraModel.load(options.checkpoint, dtype="float32")
    windows, hidden = _heads_inputs(model, texts, out, settings, options.seq_len, log)
    base = [
        read_tensors(
            Path(options.checkpoint) / spec.file, manifest.head_shapes(spec), dtype=torch.float32
        )
        for spec in manifest.llm_heads
    ]
    tuned = TunedHeads(model, base, options.lora_rank, options.seed)
    optimizer = torch.optim.AdamW(list(tuned.parameters.values()), lr=options.lr, weight_decay=0.0)
    losses: list[list[float]] = []
    if resuming:
        losses = load_state(out, tuned.parameters, optimizer)
        log(f"{out}: resuming at step {len(losses)} of {options.steps}")
    resumed_at = len(losses)
    if resumed_at > options.steps:
        raise TrainError(
            f"{out}: the saved run is at step {resumed_at}, past --steps {options.steps}; "
            "pass --force to start over"
        )
    for step in range(resumed_at, options.steps):
        inputs, targets = _batch(windows, hidden, options, step)
        step_losses = _train_step(tuned, optimizer, inputs, targets)
        losses.append(step_losses)
        if (step + 1) % options.save_every == 0 or step + 1 == options.steps:
            save_state(out, settings, tuned.parameters, optimizer, losses)
        if on_step is not None:
            on_step(step + 1, options.steps, step_losses)
    record = {
        **training_record(options, losses),
        "data": str(options.data),
        "data_sha256": file_digest(options.data),
        "seq_len": options.seq_len,
        "shards": "round robin: head i trains on texts i, i + n, i + 2n, ... (n heads)",
        "final_losses": dict(zip(heads, losses[-1], strict=True)),
    }
    sources = [f"train-heads: shard {i} of {options.data}" for i in range(len(heads))]
    write_checkpoint(options, manifest, tuned, sources, ("training", record))
    log(f"wrote {out}")
    return TrainResult(out, heads, losses, resumed_at, time.perf_counter() - began)


def check_options(options: TrainOptions, manifest: Manifest) -> None:
    if Path(options.out).resolve() == Path(options.checkpoint).resolve():
        raise TrainError("--out must be a new directory, not the --checkpoint itself")
    if manifest.quantization is not None:
        raise TrainError(
            f"{options.checkpoint} is quantized ({manifest.quantization.method}); train the "
            f"heads of its float checkpoint, then quantize the result (`hydra-jury quantize`)"
        )
    minimums = {
        "--steps": (options.steps, 1),
        "--batch-size": (options.batch_size, 1),
        "--seq-len": (options.seq_len, 2),
        "--save-every": (options.save_every, 1),
        "--seed": (options.seed, 0),
    }
    for flag, (value, minimum) in minimums.items():
        if value < minimum:
            raise TrainError(f"{flag} must be at least {minimum}, got {value}")
    rate = options.learning_rate
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise TrainError(f"--lr must be a positive number, got {rate}")
    config = manifest.decoder
    if options.seq_len > config.max_position_embeddings:
        raise TrainError(
            f"--seq-len {options.seq_len} exceeds the model's context length "
            f"{config.max_position_embeddings}"
        )
    rank = options.lora_rank
    # Every adapted projection has at least this many rows and columns.
    largest = min(config.hidden_size, config.q_size, config.kv_size, config.intermediate_size)
    if rank is not None and not 1 <= rank <= largest:
        raise TrainError(
            f"--lora {rank}: the rank must be between 1 and {largest} (the narrowest "
            f"projection of this model)"
        )


def _settings(options: TrainOptions, manifest: Manifest, heads: list[str]) -> dict[str, Any]:
    """What decides a run's result: a run resumes only from a state of equal settings.
    (`steps` is not among them: a run may be extended; `save_every` changes nothing.)"""
    return {
        "checkpoint": checkpoint_fingerprint(options.checkpoint),
        "data": file_digest(options.data),
        "heads": heads,
        "lora_rank": options.lora_rank,
        "learning_rate": options.lr,
        "batch_size": options.batch_size,
        "seq_len": options.seq_len,
        "seed": options.seed,
    }


def prepare_out(
    out: Path, settings: dict[str, Any], options: TrainOptions, log: Callable[[str], None]
) -> bool:
    """Clears `out` for a fresh run or checks it for a resumed one; True when resuming.
    What cannot be resumed is refused, or with `replace_stale` replaced."""
    if options.force and out.exists():
        shutil.rmtree(out)
    if not out.exists():
        return False
    saved = saved_settings(out)
    stale = _unresumable(out, settings, saved)
    if stale is None:
        return saved is not None
    if not options.replace_stale:
        raise TrainError(stale)
    log(f"{out}: starting over ({stale})")
    shutil.rmtree(out)
    return False


def _unresumable(out: Path, settings: dict[str, Any], saved: dict[str, Any] | None) -> str | None:
    """Why the run cannot go on from what `out` holds (None: it can)."""
    unfinished = {p.name for p in out.iterdir()} <= {state_dir(out).name}
    if not unfinished:
        return f"{out} already exists; pass --force to overwrite it"
    if saved is not None and saved != settings:
        changed = sorted(key for key in settings if saved.get(key) != settings[key])
        return (
            f"{out} holds an unfinished run with other settings ({', '.join(changed)}); "
            "run it with its own arguments to finish it, or pass --force to start over"
        )
    return None


def _heads_inputs(
    model: HydraModel,
    texts: list[str],
    out: Path,
    settings: dict[str, Any],
    seq_len: int,
    log: Callable[[str], None],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per shard: windows [W, seq_len] and the trunk's outputs for them [W, seq_len, D],
    from the run's state when it has them."""
    saved = load_hidden(out, settings)
    if saved is not None:
        return saved
    tokenizer = model.load_tokenizer()
    eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else tokenizer.eos_token_id
    windows = []
    for index, shard in enumerate(shard_texts(texts, len(settings["heads"]))):
        packed = pack_windows(shard, tokenizer, seq_len, eos)
        if len(packed) == 0:
            raise CorpusError(
                f"shard {index} (head {settings['heads'][index]}) holds fewer than --seq-len "
                f"{seq_len} tokens: add texts or lower --seq-len"
            )
        windows.append(packed)
    total = sum(len(w) for w in windows)
    log(f"trunk: hidden states of {total} windows of {seq_len} tokens")
    hidden = [_trunk_outputs(model, shard) for shard in windows]
    save_hidden(out, settings, windows, hidden)
    return windows, hidden


def _trunk_outputs(model: HydraModel, windows: torch.Tensor) -> torch.Tensor:
    count, length = windows.shape
    hidden = torch.empty(count, length, model.config.hidden_size)
    for first in range(0, count, HIDDEN_BATCH):
        batch = windows[first : first + HIDDEN_BATCH]
        segments = [Segment(None, 0, length)] * len(batch)
        outputs = model.trunk.forward_ragged(batch.reshape(-1), segments)  # [B·T, D]
        # Copied out of inference mode: the heads' backward pass reads these.
        hidden[first : first + len(batch)] = outputs.view(len(batch), length, -1)
    return hidden


def window_order(seed: int, head: int, epoch: int, count: int) -> torch.Tensor:
    """The order of a shard's `count` windows in one pass over it."""
    key = hashlib.sha256(f"{seed}/{head}/{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randperm(count, generator=generator)


def _batch(
    windows: list[torch.Tensor], hidden: list[torch.Tensor], options: TrainOptions, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs [S, B, T, D] and targets [S, B, T]: a function of the step alone,
    so a resumed run draws what an uninterrupted one would."""
    inputs, targets = [], []
    for head, (shard_windows, shard_hidden) in enumerate(zip(windows, hidden, strict=True)):
        count = len(shard_windows)
        picks = []
        for drawn in range(step * options.batch_size, (step + 1) * options.batch_size):
            epoch, offset = divmod(drawn, count)
            picks.append(int(window_order(options.seed, head, epoch, count)[offset]))
        inputs.append(shard_hidden[picks])
        targets.append(shard_windows[picks])
    return torch.stack(inputs), torch.stack(targets)


def _train_step(
    tuned: TunedHeads, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> list[float]:
    heads, batch, length, width = inputs.shape
    logits = tuned.head_stack().forward_training(
        inputs.view(heads, batch * length, width), [length] * batch
    )  # [S, B·T, V]
    labels = torch.full_like(targets, IGNORED)
    labels[:, :, :-1] = targets[:, :, 1:]
    per_token = F.cross_entropy(
        logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=IGNORED, reduction="none"
    )
    per_head = per_token.view(heads, -1).sum(dim=1) / (batch * (length - 1))  # [S]
    optimizer.zero_grad(set_to_none=True)
    per_head.sum().backward()
    for index in range(heads):
        torch.nn.utils.clip_grad_norm_(tuned.head_parameters(index), CLIP_NORM)
    optimizer.step()
    return per_head.tolist()


def training_record(options: TrainOptions, losses: list[list[float]]) -> dict[str, Any]:
    """What every run records in the manifest."""
    return {
        "base": str(options.checkpoint),
        "method": options.method,
        "lora_rank": options.lora_rank,
        "steps": len(losses),
        "learning_rate": options.lr,
        "batch_size": options.batch_size,
        "seed": options.seed,
    }


def write_checkpoint(
    options: TrainOptions,
    manifest: Manifest,
    tuned: TunedHeads,
    sources: list[str],
    record: tuple[str, dict[str, Any]],
) -> None:
    """Turns `OUT` into the trained checkpoint: written whole beside the run's state,
    moved in with the manifest last, then the state removed. `sources[i]` describes
    trained head i in the manifest; `record` is (key, value) added to it."""
    source, out = Path(options.checkpoint), Path(options.out)
    staging = state_dir(out) / "checkpoint"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / HEADS_DIR).mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name != MANIFEST:
            shutil.copyfile(path, staging / path.name)
    dtype = DTYPES[manifest.dtype]
    trained = dict(zip(tuned.model.head_names, range(len(tuned.base)), strict=True))
    specs = []
    for spec in manifest.heads:
        target = staging / spec.file
        if spec.name not in trained:
            shutil.copyfile(source / spec.file, target)
            specs.append(spec)
            continue
        index = trained[spec.name]
        save_tensors(_trained_tensors(tuned, index, staging), target, dtype)
        specs.append(dataclasses.replace(spec, source=sources[index]))
    key, value = record
    trained_manifest = dataclasses.replace(
        manifest, heads=tuple(specs), extra={**manifest.extra, key: value}
    )
    text = json.dumps(trained_manifest.to_dict(), indent=2) + "\n"
    (staging / MANIFEST).write_text(text)
    for path in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST):
        os.replace(path, out / path.name)
    shutil.rmtree(state_dir(out))


def _trained_tensors(tuned: TunedHeads, index: int, staging: Path) -> dict[str, torch.Tensor]:
    """Head `index` as it will be stored: the trained tensors, or with LoRA the base
    with its adapter merged (written first, and merged by the builder's own code)."""
    if tuned.lora_rank is None:
        return {name: t.detach() for name, t in tuned.current(index).items()}
    model = tuned.model
    adapter_dir = staging / ADAPTERS_DIR / model.head_names[index]
    save_adapter(adapter_dir, tuned.lora_rank, tuned.lora_alpha, tuned.adapter(index))
    tensors = dict(tuned.base[index])
    for name, delta in lora_deltas(
        adapter_dir, model.manifest.trunk_layers, model.config.num_layers
    ).items():
        tensors[name] = tensors[name] + delta
    return tensors


class ProgressBar:
    """An `on_step` for a terminal: a bar on stderr with each head's latest loss."""

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, step: int, steps: int, losses: list[float]) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=step - 1, desc="train-heads", file=sys.stderr)
        self._bar.update(1)
        losses_text = " ".join(f"{loss:.3f}" for loss in losses)
        self._bar.set_postfix_str(f"loss per head {losses_text}", refresh=False)
        if step == steps:
            self._bar.close()
