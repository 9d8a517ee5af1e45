"""The end-to-end proof of masked attention: change token p and watch which logits move. Those before p stay exactly
the same; with sliding windows in every layer, none past p + receptive_field - 1 move. Both paths, the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import ATTN_IMPLS, GPT


@dataclass
class CausalityReport:
    position: int  # the token that was changed
    changes: dict[str, torch.Tensor]  # attn_impl -> largest |change| of the logits at each position, (T,)
    receptive_field: int | None = None  # the model's (GPTConfig.receptive_field); None: every later position

    @property
    def length(self) -> int:
        return len(next(iter(self.changes.values())))

    @property
    def last_reachable(self) -> int:
        """The last position the change may reach."""
        reach = self.length if self.receptive_field is None else self.position + self.receptive_field
        return min(self.length, reach) - 1

    @property
    def unreachable(self) -> torch.Tensor:
        """(T,) True where the change must not reach: before it, and past the receptive field."""
        positions = torch.arange(self.length)
        return (positions < self.position) | (positions > self.last_reachable)

    @property
    def mask_held(self) -> bool:
        return all(bool((c[self.unreachable] == 0).all()) for c in self.changes.values())

    @property
    def information_flows(self) -> bool:
        return all(bool((c[~self.unreachable] > 0).all()) for c in self.changes.values())


def check_causality(model: GPT, ids: list[int], position: int | None = None,
                    replacement: int | None = None) -> CausalityReport:
    """Change token `position` (to `replacement`, default the next id) and compare logits on every attention path.
    Default position: the middle, or the one centring the receptive field's span, so unchanged ones show either side."""
    if position is None:
        field = model.config.receptive_field
        position = len(ids) // 2 if field is None or len(ids) < field + 2 else (len(ids) - field) // 2
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    perturbed = idx.clone()
    changed = (int(idx[0, position]) + 1) % model.config.vocab_size if replacement is None else replacement
    if changed == int(idx[0, position]):  # nothing would change, and "the mask held" would prove nothing
        raise ValueError(f"token {position} would be replaced by itself; the check needs another token")
    perturbed[0, position] = changed
    changes = {}
    attentions = [block.attn for block in model.transformer.h]
    training = model.training
    model.eval()
    try:
        for impl in ATTN_IMPLS:  # the same weights on each path: the layers switched in place, then back
            for attn in attentions:
                attn.attn_impl = impl
            with torch.no_grad():
                before, _ = model(idx)
                after, _ = model(perturbed)
            changes[impl] = (after - before)[0].abs().amax(dim=-1).float().cpu()
    finally:
        for attn in attentions:
            attn.attn_impl = model.config.attn_impl
        model.train(training)
    return CausalityReport(position, changes, model.config.receptive_field)


def format_report(report: CausalityReport, tokens: list[str], changed_to: str, positions: bool = False) -> str:
    """A summary by range of positions (or, positions=True, one line per position), then the verdict."""
    t, last, impls = report.position, report.last_reachable, list(report.changes)
    lines = [f"causality check: token {t} {tokens[t]!r} changed to {changed_to!r}; largest |change| of the logits"]
    if positions:
        lines[0] += " at each position:"
        lines.append(f"{'pos':>5}  {'token':<8}" + "".join(f"{impl:>12}" for impl in impls))
        for i, token in enumerate(tokens):
            marker = "  <- changed" if i == t else ""
            cells = "".join(f"{report.changes[impl][i].item():>12.3g}" for impl in impls)
            lines.append(f"{i:>5}  {token!r:<8}{cells}{marker}")
    else:
        lines[0] += ", by range of positions (check_causal_positions=true lists each one):"
        ranges = [("before it", 0, t - 1), ("from it on" if last == report.length - 1 else "in its reach", t, last)]
        ranges.append(("beyond its reach", last + 1, report.length - 1))
        for name, a, b in ranges:
            if a <= b:
                largest = ", ".join(f"{impl} {report.changes[impl][a : b + 1].max().item():.3g}" for impl in impls)
                lines.append(f"  positions {a}-{b} ({name}): {largest}")
    lines.append(verdict(report))
    return "\n".join(lines)


def verdict(report: CausalityReport) -> str:
    """One line: whether the mask held, with the range of positions expected to change and the one found."""
    paths = " and ".join(report.changes)
    t, last, end = report.position, report.last_reachable, report.length - 1
    if report.receptive_field is None:
        expected = f"positions {t}-{end}"
    else:
        expected = f"positions {t}-{last} (receptive field: {report.receptive_field} tokens)"
    if not report.mask_held:
        leaks = ", ".join(f"{impl}: {int((c[report.unreachable] != 0).sum())}" for impl, c in report.changes.items())
        return f"MASK LEAKED: positions outside the expected {expected} changed ({leaks})"
    unchanged = " and ".join(f"{a}-{b}" for a, b in ((0, t - 1), (last + 1, end)) if a <= b) or "none"
    found = " / ".join(sorted({_changed_span(c) for c in report.changes.values()}))
    held = f"mask held: positions {unchanged} are unchanged on {paths}, expected {expected} to change, found {found}"
    return held + " changed" + ("" if report.information_flows else f" ({_unchanged_inside(report)})")


def _changed_span(change: torch.Tensor) -> str:
    changed = change.nonzero().flatten().tolist()
    return f"{changed[0]}-{changed[-1]}" if changed else "none"


def _unchanged_inside(report: CausalityReport) -> str:
    """Far from the changed token its effect on a logit can be below float32's resolution, and round to 0."""
    counts = {impl: int((c[~report.unreachable] == 0).sum()) for impl, c in report.changes.items()}
    inside = ", ".join(f"{n} on {impl}" for impl, n in counts.items() if n)
    return f"positions inside the range that rounded to no change: {inside}"
