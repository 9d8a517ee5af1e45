"""The loss of each split, the same windows at every evaluation and whatever the number of processes; and
HellaSwag's accuracy when train.hellaswag_every asks for it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.runtime import Runtime
from data.batches import EVAL_WINDOWS, TokenFiles, batch_generator, every_window, get_batch
from data.prepare import PreparedData
from evals.hellaswag import Example, hellaswag_sums
from evals.perplexity import TextScore, token_sums
from training.distributed import World
from training.schema import OptimConfig

SPLIT_KEYS = {"train": 0, "val": 1}  # batch_generator's key for each split's own evaluation windows


@dataclass(frozen=True)
class Losses:
    train: float
    val: float
    val_bpb: float  # val in bits per byte of text: comparable across tokenizers


@dataclass
class Evaluator:
    """Mean loss over the same eval_iters random windows of each split at every evaluation, or over every block of
    the val split with train.full_val; and val in bits per byte: the nats of the tokens that are text over their
    UTF-8 bytes, special tokens such as <|endoftext|> left out of both (as nanochat).

    The batches are the same whatever the number of processes: each rank takes every world.size-th one and the
    sums are reduced, so the result is the whole set's (not rank 0's share).
    """

    data: PreparedData
    opt: OptimConfig
    seed: int
    block_size: int
    byte_lengths: torch.Tensor  # UTF-8 bytes of each token id (0: a special token), float64 on the device
    runtime: Runtime
    world: World

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> Losses:
        model.eval()
        train = TextScore.of(self._sums(model, self._batches("train", self.data.train)))
        val = TextScore.of(self._sums(model, self._batches("val", self.data.val)))
        model.train()
        return Losses(train.loss, val.loss, val.bpb)

    def _batches(self, split: str, files: TokenFiles) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if split == "val" and self.opt.full_val:
            # The result doesn't depend on the batch size; bigger batches keep small models' matmuls efficient.
            windows = max(self.opt.batch_size, 4096 // self.block_size)  # at least 4096 tokens a batch
            return every_window(files, windows, self.block_size)
        generator = batch_generator(self.seed, EVAL_WINDOWS, SPLIT_KEYS[split])
        return (get_batch(files, self.opt.batch_size, self.block_size, generator) for _ in range(self.opt.eval_iters))

    def _sums(self, model: torch.nn.Module, batches: Iterator) -> list[float]:
        """Nats and count of all target tokens; nats and UTF-8 bytes of the text ones; over all ranks."""
        sums = torch.zeros(4, dtype=torch.float64, device=self.runtime.device)
        for x, y, counted in share_of(batches, self.world):
            with self.runtime.autocast():
                logits, _ = model(x.to(self.runtime.device))
            if counted:
                sums += token_sums(logits, y.to(self.runtime.device), self.byte_lengths)
        return self.world.all_reduce_sum(sums).tolist()


def share_of(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], world: World
) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every world.size-th batch, starting at this rank's. All ranks run the same number of forward passes
    (FSDP2 gathers weights collectively): a rank with no batch left in the last round repeats one, uncounted."""
    while True:
        round_ = list(itertools.islice(batches, world.size))
        if not round_:
            return
        if world.rank < len(round_):
            yield (*round_[world.rank], True)
        else:
            yield (*round_[0], False)


@dataclass
class HellaSwagEval:
    """HellaSwag accuracy at the evaluations whose iteration is a multiple of `every` (train.hellaswag_every).
    Each rank scores every world.size-th example (share_of: the same number of forward passes on every rank,
    as FSDP2 needs) and the counts are summed over the ranks: the whole set's accuracy, however many processes."""

    examples: list[Example]
    every: int
    block_size: int
    runtime: Runtime
    world: World

    def due(self, iteration: int) -> bool:
        return iteration % self.every == 0

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        model.eval()
        shares = share_of(((example,) for example in self.examples), self.world)
        sums = hellaswag_sums(model, shares, self.block_size, self.runtime.device, self.runtime.autocast)
        model.train()
        correct, correct_norm, count = self.world.all_reduce_sum(sums.to(self.runtime.device)).tolist()
        return {"hellaswag_acc": correct / count, "hellaswag_acc_norm": correct_norm / count}
