"""The uncertainty head: how likely a generated multiple-choice answer is to be correct.

After the answer is generated, a second pass asks the uncertainty head (role
`uncertainty`) about it:

- witness: of the loaded `llm` heads, the one that gives the answer's first token the
  highest probability after the prompt (temperature 1); its last hidden state there
  (before the final norm) is the witness hidden state. The rule depends only on the
  prompt and the answer, so both transports and training pick the same witness.
- check prompt: `check_text(question, answer)` in the chat template, as a user message
  with the assistant's turn opened.
- the trunk runs over the check prompt; the witness hidden state is added to the trunk's
  output at the last position (injected into the residual stream the head reads); the
  uncertainty head's logits there give p_correct = sigmoid(z[A] − z[B]), with A and B
  the tokens of "A" and "B".

Every forward here runs without a cache: the pass is stateless and touches no session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.model import HydraModel

UNCERTAINTY_ROLE = "uncertainty"
CORRECT_LETTER, WRONG_LETTER = "A", "B"


def check_text(question: str, answer: str) -> str:
    """The second pass's user message."""
    return (
        f"{question} Answer: {answer}\n"
        f"Task: Reply {CORRECT_LETTER} (correct) or {WRONG_LETTER} (wrong): "
    )


def user_turn_tokens(tokenizer, content: str) -> list[int]:
    """`content` as a user message with the assistant's turn opened, encoded as the
    orchestrator encodes a chat request (plain text without a chat template)."""
    if tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])
    return list(tokenizer.encode(content, add_special_tokens=False))


def check_tokens(tokenizer, question: str, answer: str) -> list[int]:
    """The second pass's prompt, encoded."""
    return user_turn_tokens(tokenizer, check_text(question, answer))


def verdict_tokens(tokenizer) -> tuple[int, int]:
    """The token ids of "A" and "B"; ValueError when the tokenizer cannot tell them
    apart as single tokens."""
    ids = [tokenizer.encode(letter, add_special_tokens=False) for letter in "AB"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if any(len(i) != 1 or i[0] == unknown for i in ids) or ids[0] == ids[1]:
        raise ValueError(
            f'the tokenizer has no single tokens for "{CORRECT_LETTER}" and "{WRONG_LETTER}" '
            "(the uncertainty head answers with one of them)"
        )
    return ids[0][0], ids[1][0]


def load_uncertainty_head(model: HydraModel) -> HeadStack | None:
    """The checkpoint's uncertainty head, in the model's dtype, or None without one."""
    if not any(head.role == UNCERTAINTY_ROLE for head in model.manifest.heads):
        return None
    loaded = HydraModel.load(
        model.directory,
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        role=UNCERTAINTY_ROLE,
        load_trunk=False,
    )
    return loaded.heads


@dataclass(frozen=True)
class Witness:
    index: int  # into the model's loaded llm heads
    hidden: torch.Tensor  # [D], the head's last hidden state before the final norm
    probability: float  # the head's probability of the answer's first token


@torch.inference_mode()
def find_witness(model: HydraModel, prompt: torch.Tensor, answer_token: int) -> Witness:
    """prompt: token ids [T] the answer continued; answer_token: the answer's first."""
    segments = [Segment(None, 0, len(prompt))]
    hidden = model.trunk.forward_ragged(prompt, segments)
    last = torch.tensor([len(prompt) - 1])  # the LM heads run there only
    logits, states = model.heads.forward_ragged(hidden, segments, return_hidden=True, rows=last)
    return witness_from(logits[:, 0], states[:, 0], answer_token)


def witness_from(logits: torch.Tensor, states: torch.Tensor, answer_token: int) -> Witness:
    """The witness among the heads' logits [S, V] and last hidden states [S, D] after a
    prompt (from `find_witnesses`, or from the prefill that generated the answer)."""
    probabilities = torch.softmax(logits, dim=-1)[:, answer_token]  # [S]
    head = int(probabilities.argmax())
    return Witness(head, states[head], float(probabilities[head]))


def check_hidden(model: HydraModel, check: torch.Tensor, witness: torch.Tensor) -> torch.Tensor:
    """The uncertainty head's input [T, D]: the trunk's outputs over the check prompt
    `check` [T], the witness hidden state added at the last position."""
    return check_hiddens(model, [check], [witness])[0]


@torch.inference_mode()
def check_hiddens(
    model: HydraModel, checks: list[torch.Tensor], witnesses: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`check_hidden` of each check prompt and witness, the trunk in one ragged pass."""
    segments = [Segment(None, 0, len(check)) for check in checks]
    hidden = model.trunk.forward_ragged(torch.cat(checks), segments)
    inputs = []
    for part, witness in zip(hidden.split([len(c) for c in checks]), witnesses, strict=True):
        part = part.clone()
        part[-1] += witness.to(part.dtype)
        inputs.append(part)
    return inputs


def verdict_logit(logits: torch.Tensor, verdict: tuple[int, int]) -> torch.Tensor:
    """z[A] − z[B] of logits [..., V]: p_correct is its sigmoid."""
    return logits[..., verdict[0]] - logits[..., verdict[1]]


@torch.inference_mode()
def p_correct(head: HeadStack, hidden: torch.Tensor, verdict: tuple[int, int]) -> float:
    last = torch.tensor([len(hidden) - 1])
    logits = head.forward_ragged(hidden, [Segment(None, 0, len(hidden))], rows=last)  # [1, 1, V]
    return float(torch.sigmoid(verdict_logit(logits[0, 0], verdict)))
