"""The calls a decoding loop makes on the workers, and what they return.

Each call is one object that travels unchanged from the engine through the backend
interface, either transport (in-process or gRPC, where `serving.internal_wire` turns it
into a message and back) and the servicers to the worker. Checks that need no model run
when a call is built (a bad call never reaches a worker); checks against the model (token
ids, head names, tensor shapes) run in the worker, before it opens a session.

Terms
- session: the id of the caches a call works on; start: the position they start from
  (the position rule, `workers.sessions`).
- pending token: the last committed token, not yet processed by any component.
- γ (gamma): draft tokens per round, at most `MAX_GAMMA`.
- hidden states: trunk outputs of some positions, handed from a draft (or a trunk
  prefill) to the jury. The loop never looks inside: `HiddenStates` is an opaque handle
  whose payload is whatever the transport carries.
- decision distributions: the draft and target at temperature 1 without filters; the
  cascade rules decide on them (`poe.rules`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.poe.randomness import MAX_SEED
from hydra_jury.workers.errors import InvalidArgument

MAX_GAMMA = 16  # draft tokens per round: the services' and the orchestrator's limit
MAX_BETA = 100.0  # largest verifier inverse temperature


def check_sampling(sampling: SamplingParams, vocab_size: int | None = None) -> None:
    """`SamplingParams.validate` as an `InvalidArgument` naming the field (the vocabulary
    bound on top_k is checked once the worker knows the model)."""
    try:
        sampling.validate(vocab_size)
    except ValueError as error:
        raise InvalidArgument(f"sampling: {error}") from None


def _check_session(session: str, start: int) -> None:
    if not session:
        raise InvalidArgument("session: a non-empty session id is required")
    if start < 0:
        raise InvalidArgument(f"start: must be >= 0, got {start}")


@dataclass(frozen=True)
class HiddenStates:
    """Trunk outputs of `rows` consecutive positions, opaque to the loop.

    `payload` is what the transport carries: a tensor [rows, D] in-process (left on the
    model's device) and inside a service, the encoded `Tensor` message between services
    (the orchestrator forwards it from the trunk's response to the shards' requests
    without decoding it)."""

    rows: int
    payload: Any

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor [rows, D]; only a worker asks for it."""
        if not isinstance(self.payload, torch.Tensor):
            raise TypeError(
                f"hidden states hold a {type(self.payload).__name__}, not a tensor: "
                "decode them at the service edge first"
            )
        return self.payload

    def on_host(self) -> HiddenStates:
        """The hidden states copied to the host (for encoding)."""
        (tensor,) = to_host([self.tensor()])
        return HiddenStates(self.rows, tensor)


@dataclass(frozen=True)
class PrefillCall:
    """Tokens [T] at positions start.. into the trunk (and, in a backend, the jury, which
    fills the caches of `heads` now: the request's jurors and amateur)."""

    session: str
    start: int
    tokens: torch.Tensor  # [T] long
    heads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_session(self.session, self.start)
        if self.tokens.dtype != torch.long or self.tokens.dim() != 1 or not len(self.tokens):
            raise InvalidArgument("tokens: at least one token is required")


@dataclass(frozen=True)
class JuryPrefillCall:
    """Hidden states of positions start.., kept by the jury, and into the caches of the
    hosted heads among `heads` (the others catch up from them when a call names them)."""

    session: str
    start: int
    hidden: HiddenStates
    heads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_session(self.session, self.start)
        if self.hidden.rows < 1:
            raise InvalidArgument("hidden: at least one position is required")
        if len(set(self.heads)) != len(self.heads):
            raise InvalidArgument(f"heads: a head is named twice in {list(self.heads)}")


@dataclass(frozen=True)
class DraftCall:
    """γ trunk + draft-head steps from the pending token at position `start`; with
    `draft_model`, γ steps of the trunk service's draft model and then one trunk forward
    over the pending token and the γ drafts (γ + 1 positions); with neither, one trunk
    step and no draft: over the pending token alone (non-speculative decoding), or over
    it and `outside_drafts`, k tokens drafted outside the services (prompt lookup) that
    the jury then checks in one pass (k + 1 positions). A one-pass check is a step like a
    plain one, so a server batches it with the other sessions' steps: one trunk forward
    for all, where a forward of its own would stream the weights twice per step."""

    session: str
    start: int
    pending: int
    gamma: int
    draft_head: str | None
    sampling: SamplingParams
    seed: int
    with_decision: bool = False  # also return the decision distributions
    draft_model: bool = False  # draft with the draft model instead of a head
    outside_drafts: tuple[int, ...] = ()  # fed after the pending token; nothing drawn

    def __post_init__(self) -> None:
        _check_session(self.session, self.start)
        if not 1 <= self.gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma: must be in 1..{MAX_GAMMA}, got {self.gamma}")
        if self.draft_model and self.draft_head is not None:
            raise InvalidArgument("draft_head: must be empty when drafting with the draft model")
        if self.outside_drafts and (self.draft_model or self.draft_head is not None):
            raise InvalidArgument(
                "outside_drafts: only a call that drafts nothing itself checks outside drafts"
            )
        if len(self.outside_drafts) > MAX_GAMMA:
            raise InvalidArgument(
                f"outside_drafts: at most {MAX_GAMMA}, got {len(self.outside_drafts)}"
            )
        if self.draft_head is None and not self.draft_model and self.gamma != 1:
            raise InvalidArgument(
                f"gamma: must be 1 without a draft_head (one trunk step), got {self.gamma}"
            )
        if not 0 <= self.seed < MAX_SEED:
            raise InvalidArgument(f"seed: must be below 2**63 and >= 0, got {self.seed}")
        check_sampling(self.sampling)

    @property
    def positions(self) -> int:
        """The positions whose trunk outputs the call returns, from `start`: γ drafted by
        a head, γ + 1 with the draft model, else the pending token and the outside
        drafts."""
        if self.draft_head is not None:
            return self.gamma
        return self.gamma + 1 if self.draft_model else 1 + len(self.outside_drafts)

    @property
    def trunk_tokens(self) -> list[int]:
        """The tokens the call's first trunk step runs over: the pending token, and the
        outside drafts after it."""
        return [self.pending, *self.outside_drafts]


@dataclass(frozen=True)
class ScoreCall:
    """The jurors' partial log-product over the hidden states of positions start.."""

    session: str
    start: int
    hidden: HiddenStates
    jury: tuple[str, ...]  # every juror of the request; a shard scores those it hosts
    temperature: float  # 0 = greedy (computed at 1)
    beta: float
    with_decision: bool = False  # also return the temperature-1 log-product
    amateur: str | None = None  # also return this head's log-probabilities (contrastive)

    def __post_init__(self) -> None:
        _check_session(self.session, self.start)
        if self.hidden.rows < 1:
            raise InvalidArgument("hidden: at least one position is required")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(
                f"temperature: must be finite and >= 0 (0 = greedy), got {self.temperature}"
            )
        if not (math.isfinite(self.beta) and 0 < self.beta <= MAX_BETA):
            raise InvalidArgument(f"beta: must be in (0, {MAX_BETA:g}], got {self.beta}")
        if len(set(self.jury)) != len(self.jury):
            raise InvalidArgument(f"jury: a head is named twice in {list(self.jury)}")
        if self.amateur is not None and self.amateur in self.jury:
            raise InvalidArgument(f"amateur: {self.amateur!r} is also a juror")

    @property
    def heads(self) -> tuple[str, ...]:
        """The heads the call evaluates: the jurors and the amateur."""
        return (*self.jury, *([self.amateur] if self.amateur else []))


@dataclass(frozen=True)
class UncertaintyCall:
    """The uncertainty head's second pass over a finished answer (stateless: no session).
    See `hydra_model.uncertainty`."""

    prompt: torch.Tensor  # [T] long: the context the answer continued
    answer_token: int  # the answer's first token
    check: torch.Tensor  # [T'] long: the check prompt
    verdict: tuple[int, int]  # the token ids of "A" (correct) and "B" (wrong)

    def __post_init__(self) -> None:
        for name in ("prompt", "check"):
            tokens = getattr(self, name)
            if tokens.dtype != torch.long or tokens.dim() != 1 or not len(tokens):
                raise InvalidArgument(f"{name}: at least one token is required")
        if len(self.verdict) != 2 or self.verdict[0] == self.verdict[1]:
            raise InvalidArgument(f"verdict: two different token ids, got {self.verdict}")


@dataclass(frozen=True)
class UncertaintyResult:
    p_correct: float
    witness_head: str  # the llm head whose hidden state was injected

    def on_host(self) -> UncertaintyResult:
        return self


@dataclass(frozen=True)
class DraftResult:
    tokens: torch.Tensor  # [γ] long; empty when no draft head was asked for
    logprobs: torch.Tensor | None  # [γ, V] draft distributions, tempered and filtered
    decision_logprobs: torch.Tensor | None  # [γ, V] at temperature 1, unfiltered
    # trunk outputs of positions start..start+γ-1 (start..start+γ with the draft model)
    hidden: HiddenStates
    trunk_steps: int = 0  # trunk positions this call ran
    head_evaluations: int = 0  # draft-head positions of the round (not the catch-up)

    def on_host(self) -> DraftResult:
        """The tokens and distributions on the host; the hidden states stay where they
        are (they go on to the jury)."""
        return _tensors_on_host(self, exclude="hidden")


@dataclass(frozen=True)
class ScoreResult:
    log_product: torch.Tensor  # [γ, V] Σ over the jurors of β·log_softmax(z/T)
    decision_log_product: torch.Tensor | None  # [γ, V] the same at temperature 1
    votes: torch.Tensor  # [γ, J] long, argmax of each juror below
    voters: tuple[str, ...]  # the jurors, in checkpoint order
    head_evaluations: int = 0  # positions × heads the call ran
    # [γ, V] log_softmax(z_amateur / T) when the call named an amateur this worker hosts
    amateur_logprobs: torch.Tensor | None = None

    def on_host(self) -> ScoreResult:
        return _tensors_on_host(self)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host. A GPU's are copied into pinned buffers (PyTorch's caching
    host allocator keeps them), every copy queued before one wait for the device: a
    result costs one host synchronisation, not one per tensor. Host tensors pass as they
    are."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if not on_device:
        return tensors
    moved = []
    for tensor in tensors:
        if tensor.device.type == "cpu":
            moved.append(tensor)
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        moved.append(host.copy_(tensor, non_blocking=True))
    for device in {t.device for t in on_device}:
        torch.cuda.current_stream(device).synchronize()
    return moved


def to_device(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`tensor` on `device` (in `dtype`): itself where it is already. `.to` would still
    make a dispatcher call, and right after a model step has pushed the interpreter out
    of the caches each costs more than the work it does."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device, dtype)


def _tensors_on_host(result, exclude: str = ""):
    names = [
        field.name
        for field in fields(result)
        if field.name != exclude and isinstance(getattr(result, field.name), torch.Tensor)
    ]
    values = [getattr(result, name) for name in names]
    moved = to_host(values)
    if moved is values:
        return result  # on the host already (a CPU model's): no new result
    return replace(result, **dict(zip(names, moved, strict=True)))
