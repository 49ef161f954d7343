"""The interfaces every stage of the pipeline shares: what a decoding loop needs from a target
and a drafter, what a request is and what it returns.

A *target* owns per-sequence KV slots and runs one ragged step (prefill and verification are
the same call). A *drafter* proposes, for each active request, a block of γ draft tokens
x_1..x_γ after the anchor x_0 (the last committed token), together with

* the distributions q_1..q_γ each token was sampled from (verification needs exactly these),
* one raw confidence logit per slot, where slot k's confidence may depend on x_0..x_{k-1}
  but never on x_k itself (it is "pre-token" information: reference notes §1.6).

The decoding loop tells the drafter what was committed: `begin` with the prompt, `advance`
after every round with the anchor and the accepted drafts (tokens whose target features now
exist), `end` when the request finishes. Implementations: dspark.models.loading (PyTorch), dspark.engines
(ONNX Runtime), dspark.orchestrator.bls (the Triton models over BLS).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dspark.core.metrics import AcceptanceStats
from dspark.core.sampling import SamplingParams


class RequestError(ValueError):
    """A malformed request: the message names the input and the limit."""


@dataclass
class TargetStep:
    """What one target step returns to the decoding loop."""

    logits: torch.Tensor  # [R, N, V] (rows padded to the longest); [R, 1, V] with last_only
    features: torch.Tensor  # [R, N, F] tapped-layer features of the new tokens
    last_hidden: torch.Tensor | None = None  # [R, N, d] final normed hidden (LM-head input)


class Target(Protocol):
    """What the loop needs from a target: KV slots and one ragged step."""

    vocab_size: int

    def allocate(self) -> int: ...
    def release(self, slot: int) -> None: ...
    def rollback(self, slot: int, length: int) -> None: ...
    def length(self, slot: int) -> int: ...
    def step(self, slots: list[int], tokens: list[list[int]], last_only: bool = False) -> TargetStep:
        """Append tokens[r] to slot slots[r]; logits of every new position, or with last_only
        only of each row's last one ([R, 1, V]: a prefill needs nothing else)."""
        ...


@dataclass
class Proposal:
    """A block of drafts per request. `probs` is q_k, the distribution x_k was sampled from:
    over the full vocabulary [R, γ, V], or — when `vocab` is set — over the draft vocabulary
    only ([R, γ, len(vocab)], zero elsewhere by construction), with `index` [R, γ] the position
    of each x_k in `vocab`. The compact form saves materialising γ × V floats per request."""

    tokens: torch.Tensor  # [R, γ] int64, x_1..x_γ
    probs: torch.Tensor  # [R, γ, V] (or [R, γ, Vd] with vocab) float32
    conf_logits: torch.Tensor  # [R, γ] raw confidence logits (before calibration)
    vocab: torch.Tensor | None = None  # [Vd] int64 token ids of the draft vocabulary
    index: torch.Tensor | None = None  # [R, γ] int64, tokens == vocab[index]

    def dense_probs(self, vocab_size: int) -> torch.Tensor:
        """q over the full vocabulary [R, γ, V] (zero outside the draft vocabulary)."""
        if self.vocab is None:
            return self.probs
        out = self.probs.new_zeros(*self.probs.shape[:2], vocab_size)
        out[..., self.vocab] = self.probs
        return out


class Drafter(ABC):
    """Anything that proposes blocks of draft tokens for a batch of requests."""

    block_size: int  # γ: draft tokens per block
    vocab_size: int

    @abstractmethod
    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """A new request: its prompt tokens and their target features [P, F]."""

    @abstractmethod
    def propose(
        self,
        rids: list[int],
        anchors: list[int],
        params: list[SamplingParams],
        gens: list[torch.Generator],
    ) -> Proposal:
        """Draft γ tokens after each anchor. Each request draws exactly γ uniforms from its
        generator, in slot order, so its random stream does not depend on the batch."""

    @abstractmethod
    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """Tokens now committed to the context (anchor + accepted drafts) and their features."""

    @abstractmethod
    def end(self, rid: int) -> None:
        """The request finished: release everything held for it."""

    def catchup_positions(self, rid: int) -> int:
        """Committed positions of `rid` that its next `propose` must first feed through a
        separate context pass (a lazy drafter keeps the features of rounds it did not draft in;
        they are fed, batched, when it drafts again). 0 for a drafter that feeds eagerly."""
        return 0

    def catchup_totals(self) -> tuple[int, float]:
        """Running totals of (positions fed through that context pass, seconds it took): the
        measured price of catching up, which dspark-skip's cost model reads."""
        return 0, 0.0


@dataclass(frozen=True)
class Request:
    prompt_ids: Sequence[int]
    max_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class RoundTrace:
    """One speculative round of one request, for calibration and acceptance analysis."""

    verified: int  # ℓ, drafts verified
    accepted: int  # drafts accepted (up to an accepted stop token)
    stopped: bool  # ended on an accepted stop token
    conf_logits: np.ndarray  # [γ] raw confidence logits of the block


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    stats: AcceptanceStats
    seconds: float = 0.0
    trace: list[RoundTrace] = field(default_factory=list)
