"""The end-to-end proof of masked attention: change token p and watch which logits move. Those before p stay exactly
the same; with sliding windows in every layer, none past p + receptive_field - 1 move. Both paths, the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import ATTN_IMPLS, GPT


@dataclass
class CausalityReport:
    """What changing token `position` did: per attention path, the largest |change| of the logits at each position."""

    position: int
    changes: dict[str, torch.Tensor]  # attn_impl -> (T,)
    receptive_field: int | None  # the model's (GPTConfig.receptive_field); None: every later position
    last_reachable: int  # the last position the change may reach
    unreachable: torch.Tensor  # (T,) True where the change must not reach: before it, and past the receptive field
    mask_held: bool  # no change where it must not reach, on every path
    information_flows: bool  # a change everywhere it may reach, on every path


def check_causality(model: GPT, ids: list[int], position: int | None = None,
                    replacement: int | None = None) -> CausalityReport:
    """Change token `position` (to `replacement`, default the next id) and compare logits on every attention path.
    Default position: the middle, or the one centring the receptive field's span, so unchanged ones show either side."""
    field = model.config.receptive_field
    if position is None:
        position = len(ids) // 2 if field is None or len(ids) < field + 2 else (len(ids) - field) // 2
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    perturbed = idx.clone()
    perturbed[0, position] = (ids[position] + 1) % model.config.vocab_size if replacement is None else replacement
    if perturbed[0, position] == ids[position]:  # nothing would change, and "the mask held" would prove nothing
        raise ValueError(f"token {position} would be replaced by itself; the check needs another token")
    changes = {}
    attentions = [block.attn for block in model.transformer.h]
    training = model.training
    model.eval()
    try:
        for impl in ATTN_IMPLS:  # the same weights on each path: the layers switched in place, then back
            for attn in attentions:
                attn.attn_impl = impl
            with torch.no_grad():
                changes[impl] = (model(perturbed)[0] - model(idx)[0])[0].abs().amax(dim=-1).float().cpu()
    finally:
        for attn in attentions:
            attn.attn_impl = model.config.attn_impl
        model.train(training)
    last = len(ids) - 1 if field is None else min(len(ids), position + field) - 1
    unreachable = (torch.arange(len(ids)) < position) | (torch.arange(len(ids)) > last)
    held = all(bool((c[unreachable] == 0).all()) for c in changes.values())
    flows = all(bool((c[~unreachable] > 0).all()) for c in changes.values())
    return CausalityReport(position, changes, field, last, unreachable, held, flows)


def format_report(report: CausalityReport, tokens: list[str], changed_to: str, positions: bool = False) -> str:
    """A summary by range of positions (or, positions=True, one line per position), then the verdict."""
    t, last, end, impls = report.position, report.last_reachable, len(report.unreachable) - 1, list(report.changes)
    lines = [f"causality check: token {t} {tokens[t]!r} changed to {changed_to!r}; largest |change| of the logits"]
    if positions:
        lines[0] += " at each position:"
        lines.append(f"{'pos':>5}  {'token':<8}" + "".join(f"{impl:>12}" for impl in impls))
        for i, token in enumerate(tokens):
            cells = "".join(f"{report.changes[impl][i].item():>12.3g}" for impl in impls)
            lines.append(f"{i:>5}  {token!r:<8}{cells}{'  <- changed' if i == t else ''}")
    else:
        lines[0] += ", by range of positions (check_causal_positions=true lists each one):"
        ranges = [("before it", 0, t - 1), ("from it on" if last == end else "in its reach", t, last),
                  ("beyond its reach", last + 1, end)]
        for name, a, b in ranges:
            if a <= b:
                largest = ", ".join(f"{impl} {report.changes[impl][a : b + 1].max().item():.3g}" for impl in impls)
                lines.append(f"  positions {a}-{b} ({name}): {largest}")
    return "\n".join([*lines, verdict(report)])


def verdict(report: CausalityReport) -> str:
    """One line: whether the mask held, with the range of positions expected to change and the one found. Far from
    the changed token its effect on a logit can be below float32's resolution, and round to 0: those are counted."""
    t, last, end, field = report.position, report.last_reachable, len(report.unreachable) - 1, report.receptive_field
    expected = f"positions {t}-{end}" if field is None else f"positions {t}-{last} (receptive field: {field} tokens)"
    if not report.mask_held:
        leaks = ", ".join(f"{impl}: {int((c[report.unreachable] != 0).sum())}" for impl, c in report.changes.items())
        return f"MASK LEAKED: positions outside the expected {expected} changed ({leaks})"
    unchanged = " and ".join(f"{a}-{b}" for a, b in ((0, t - 1), (last + 1, end)) if a <= b) or "none"
    spans = [c.nonzero().flatten().tolist() for c in report.changes.values()]
    found = " / ".join(sorted({f"{s[0]}-{s[-1]}" if s else "none" for s in spans}))
    held = (f"mask held: positions {unchanged} are unchanged on {' and '.join(report.changes)}, expected {expected} "
            f"to change, found {found} changed")
    rounded = ", ".join(f"{n} on {impl}" for impl, c in report.changes.items()
                        if (n := int((c[~report.unreachable] == 0).sum())))
    return f"{held} (positions inside the range that rounded to no change: {rounded})" if rounded else held
