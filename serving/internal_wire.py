"""Calls and results ⇄ `hydrajury.v1` internal messages: protobuf at the edge.

The services build calls from requests (`*_call_from_pb`) and responses from results
(`*_result_to_pb`); the orchestrator's gRPC backend does the reverse. Both sides use
this one module, so a field is converted in one place. Hidden states travel in the
model's dtype, distributions as float32. Tensors are decoded with every size checked
(`protos.codec`), and received hidden states must be finite; what needs the model
(token ids, head names) the worker checks.
"""

from __future__ import annotations

import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.protos.codec import (
    CodecError,
    concat_rows,
    optional_tensor_to_pb,
    split_rows,
    tensor_from_pb,
    tensor_to_pb,
)
from hydra_jury.protos.hydrajury.v1 import internal_pb2, tensor_pb2
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
    ScoreResult,
    UncertaintyCall,
    UncertaintyResult,
)
from hydra_jury.workers.errors import InvalidArgument

# --- hidden states ---------------------------------------------------------------------


def hidden_to_pb(hidden: HiddenStates) -> tensor_pb2.Tensor:
    """The message of a handle: a tensor is encoded, a message passes through as it is."""
    if isinstance(hidden.payload, tensor_pb2.Tensor):
        return hidden.payload
    return tensor_to_pb(hidden.tensor())


def hidden_from_pb(message: tensor_pb2.Tensor, dtype: str, hidden_size: int) -> HiddenStates:
    """Hidden states [T, hidden_size] of dtype `dtype`, decoded on the host; `CodecError`
    (INVALID_ARGUMENT) for any other shape or dtype, or a value that is not finite."""
    tensor = tensor_from_pb(message, name="hidden", dtypes=[dtype], shape=[None, hidden_size])
    # Checked here, on the host, where bytes from the network become a tensor: a NaN or
    # an infinity would spread through attention into every later position of the
    # session's caches. The in-process path hands the trunk's own outputs over unchecked.
    if not bool(torch.isfinite(tensor).all()):
        not_finite = ~torch.isfinite(tensor)  # only on the way to the error: where
        row, column = (int(index) for index in not_finite.nonzero()[0])
        raise CodecError(
            f"hidden: values must be finite, got {float(tensor[row, column])} at "
            f"[{row}, {column}] ({int(not_finite.sum())} of {tensor.numel()} not finite)"
        )
    return HiddenStates(len(tensor), tensor)


def forwarded_hidden(message: tensor_pb2.Tensor) -> HiddenStates:
    """A trunk's hidden-state message kept encoded, to be forwarded to the jury shards."""
    return HiddenStates(message.shape[0] if message.shape else 0, message)


# --- trunk -----------------------------------------------------------------------------


def prefill_call_to_pb(call: PrefillCall) -> internal_pb2.TrunkPrefillRequest:
    return internal_pb2.TrunkPrefillRequest(
        session=call.session, start=call.start, tokens=call.tokens.tolist()
    )


def prefill_call_from_pb(request: internal_pb2.TrunkPrefillRequest) -> PrefillCall:
    return PrefillCall(request.session, request.start, torch.tensor(list(request.tokens)).long())


def uncertainty_call_to_pb(call: UncertaintyCall) -> internal_pb2.UncertaintyRequest:
    return internal_pb2.UncertaintyRequest(
        prompt_tokens=call.prompt.tolist(),
        answer_token=call.answer_token,
        check_tokens=call.check.tolist(),
        correct_token=call.verdict[0],
        wrong_token=call.verdict[1],
    )


def uncertainty_call_from_pb(request: internal_pb2.UncertaintyRequest) -> UncertaintyCall:
    return UncertaintyCall(
        torch.tensor(list(request.prompt_tokens)).long(),
        request.answer_token,
        torch.tensor(list(request.check_tokens)).long(),
        (request.correct_token, request.wrong_token),
    )


def uncertainty_result_to_pb(result: UncertaintyResult) -> internal_pb2.UncertaintyResponse:
    return internal_pb2.UncertaintyResponse(
        p_correct=result.p_correct, witness_head=result.witness_head
    )


def uncertainty_result_from_pb(response: internal_pb2.UncertaintyResponse) -> UncertaintyResult:
    return UncertaintyResult(response.p_correct, response.witness_head)


# --- chunked prefill: a long prefill as consecutive prefills of at most `size` positions
# (size 0: whole), so that other sessions' calls run between its chunks -----------------


def prefill_chunks(
    request: internal_pb2.TrunkPrefillRequest, size: int
) -> list[internal_pb2.TrunkPrefillRequest]:
    tokens = list(request.tokens)
    if size <= 0 or len(tokens) <= size:
        return [request]
    return [
        internal_pb2.TrunkPrefillRequest(
            session=request.session,
            start=request.start + offset,
            tokens=tokens[offset : offset + size],
        )
        for offset in range(0, len(tokens), size)
    ]


def joined_prefill_responses(
    responses: list[internal_pb2.TrunkPrefillResponse],
) -> internal_pb2.TrunkPrefillResponse:
    """The chunks' hidden states, one after the other (the response of the whole)."""
    return internal_pb2.TrunkPrefillResponse(
        hidden=concat_rows([response.hidden for response in responses])
    )


def jury_prefill_chunks(
    request: internal_pb2.JuryPrefillRequest, size: int
) -> list[internal_pb2.JuryPrefillRequest]:
    pieces = split_rows(request.hidden, size) if size > 0 else [request.hidden]
    if len(pieces) == 1:
        return [request]
    starts = [request.start]
    for piece in pieces[:-1]:
        starts.append(starts[-1] + piece.shape[0])
    return [
        internal_pb2.JuryPrefillRequest(session=request.session, start=start, hidden=piece)
        for start, piece in zip(starts, pieces, strict=True)
    ]


def sampling_to_pb(sampling: SamplingParams) -> tensor_pb2.SamplingParams:
    return tensor_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        epsilon=sampling.epsilon,
    )


def draft_call_to_pb(call: DraftCall) -> internal_pb2.DraftRequest:
    return internal_pb2.DraftRequest(
        session=call.session,
        start=call.start,
        pending_token=call.pending,
        gamma=call.gamma,
        draft_head=call.draft_head or "",
        sampling=sampling_to_pb(call.sampling),
        seed=call.seed,
        with_decision=call.with_decision,
        draft_model=call.draft_model,
        outside_drafts=call.outside_drafts,
    )


def draft_call_from_pb(request: internal_pb2.DraftRequest) -> DraftCall:
    draft_head = request.draft_head or None
    if request.HasField("sampling"):
        message = request.sampling
        sampling = SamplingParams(
            message.temperature, message.top_k, message.top_p, message.min_p, message.epsilon
        )
    elif draft_head is None and not request.draft_model:
        sampling = SamplingParams()  # unused: nothing is drafted
    else:
        raise InvalidArgument("sampling: required when drafting")
    return DraftCall(
        request.session,
        request.start,
        request.pending_token,
        request.gamma,
        draft_head,
        sampling,
        request.seed,
        request.with_decision,
        request.draft_model,
        tuple(request.outside_drafts),
    )


def draft_result_to_pb(result: DraftResult) -> internal_pb2.DraftResponse:
    return internal_pb2.DraftResponse(
        tokens=result.tokens.tolist(),
        logprobs=optional_tensor_to_pb(result.logprobs),
        decision_logprobs=optional_tensor_to_pb(result.decision_logprobs),
        hidden=hidden_to_pb(result.hidden),
        trunk_steps=result.trunk_steps,
        head_evaluations=result.head_evaluations,
    )


def _distributions(response, name: str, rows: int, vocab_size: int) -> torch.Tensor:
    """The float32 [rows, vocab_size] field `name` of a response."""
    message = getattr(response, name)
    return tensor_from_pb(message, name=name, dtypes=["float32"], shape=[rows, vocab_size])


def draft_result_from_pb(
    response: internal_pb2.DraftResponse, call: DraftCall, vocab_size: int
) -> DraftResult:
    """The result of `call`; the hidden states stay a message, forwarded to the jury.
    `CodecError` where they are not of the call's positions (a trunk service older than
    `outside_drafts` answers a one-pass check as a plain step, one position)."""
    hidden = forwarded_hidden(response.hidden)
    if hidden.rows != call.positions:
        raise CodecError(f"hidden: {hidden.rows} positions, where the call runs {call.positions}")
    rows = len(response.tokens)
    drafting = call.draft_head is not None or call.draft_model
    decision = drafting and call.with_decision
    return DraftResult(
        torch.tensor(list(response.tokens), dtype=torch.long),
        _distributions(response, "logprobs", rows, vocab_size) if drafting else None,
        _distributions(response, "decision_logprobs", rows, vocab_size) if decision else None,
        hidden,
        trunk_steps=response.trunk_steps,
        head_evaluations=response.head_evaluations,
    )


# --- jury ------------------------------------------------------------------------------


def jury_prefill_call_to_pb(call: JuryPrefillCall) -> internal_pb2.JuryPrefillRequest:
    return internal_pb2.JuryPrefillRequest(
        session=call.session, start=call.start, hidden=hidden_to_pb(call.hidden), heads=call.heads
    )


def jury_prefill_call_from_pb(
    request: internal_pb2.JuryPrefillRequest, dtype: str, hidden_size: int
) -> JuryPrefillCall:
    hidden = hidden_from_pb(request.hidden, dtype, hidden_size)
    return JuryPrefillCall(request.session, request.start, hidden, tuple(request.heads))


def score_call_to_pb(call: ScoreCall) -> internal_pb2.ScoreRequest:
    return internal_pb2.ScoreRequest(
        session=call.session,
        start=call.start,
        hidden=hidden_to_pb(call.hidden),
        jury=call.jury,
        temperature=call.temperature,
        beta=call.beta,
        with_decision=call.with_decision,
        amateur=call.amateur or "",
    )


def score_call_from_pb(
    request: internal_pb2.ScoreRequest, dtype: str, hidden_size: int
) -> ScoreCall:
    return ScoreCall(
        request.session,
        request.start,
        hidden_from_pb(request.hidden, dtype, hidden_size),
        tuple(request.jury),
        request.temperature,
        request.beta,
        request.with_decision,
        request.amateur or None,
    )


def score_result_to_pb(result: ScoreResult) -> internal_pb2.ScoreResponse:
    return internal_pb2.ScoreResponse(
        log_product=tensor_to_pb(result.log_product.float()),
        decision_log_product=optional_tensor_to_pb(result.decision_log_product),
        votes=tensor_to_pb(result.votes.long()),
        voters=result.voters,
        head_evaluations=result.head_evaluations,
        amateur_logprobs=optional_tensor_to_pb(result.amateur_logprobs),
    )


def score_result_from_pb(
    response: internal_pb2.ScoreResponse, call: ScoreCall, vocab_size: int
) -> ScoreResult:
    """One shard's partial result for `call`."""
    rows = call.hidden.rows
    votes = tensor_from_pb(
        response.votes, name="votes", dtypes=["int64"], shape=[rows, len(response.voters)]
    )
    decision = call.with_decision
    return ScoreResult(
        _distributions(response, "log_product", rows, vocab_size),
        _distributions(response, "decision_log_product", rows, vocab_size) if decision else None,
        votes,
        tuple(response.voters),
        head_evaluations=response.head_evaluations,
        amateur_logprobs=_distributions(response, "amateur_logprobs", rows, vocab_size)
        if response.HasField("amateur_logprobs")
        else None,
    )
