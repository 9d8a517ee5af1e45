"""The end-to-end proof of masked attention: change one token and watch which logits move.

With a causal mask, the logits before the changed position stay exactly the same (a token can't see
the future) and those from it on change. Run on both attention paths with the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from model import ATTN_IMPLS, GPT


@dataclass
class CausalityReport:
    position: int  # the token that was changed
    changes: dict[str, torch.Tensor]  # attn_impl -> largest |change| of the logits at each position, (T,)

    @property
    def mask_held(self) -> bool:
        return all(bool((c[: self.position] == 0).all()) for c in self.changes.values())

    @property
    def information_flows(self) -> bool:
        return all(bool((c[self.position :] > 0).all()) for c in self.changes.values())


def check_causality(model: GPT, ids: list[int], position: int | None = None) -> CausalityReport:
    """Perturb token `position` (default: the middle one) and compare logits, for every attention path."""
    position = len(ids) // 2 if position is None else position
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    perturbed = idx.clone()
    perturbed[0, position] = (idx[0, position] + 1) % model.config.vocab_size
    changes = {}
    for impl in ATTN_IMPLS:
        twin = GPT(replace(model.config, attn_impl=impl)).to(idx.device).eval()
        twin.load_state_dict(model.state_dict())
        with torch.no_grad():
            before, _ = twin(idx)
            after, _ = twin(perturbed)
        changes[impl] = (after - before)[0].abs().amax(dim=-1).float().cpu()
    return CausalityReport(position, changes)


def format_report(report: CausalityReport, tokens: list[str], changed_to: str) -> str:
    t = report.position
    impls = list(report.changes)
    lines = [
        f"causality check: token {t} {tokens[t]!r} changed to {changed_to!r}; "
        "largest |change| of the logits at each position:",
        f"{'pos':>5}  {'token':<8}" + "".join(f"{impl:>12}" for impl in impls),
    ]
    for i, token in enumerate(tokens):
        marker = "  <- changed" if i == t else ""
        cells = "".join(f"{report.changes[impl][i].item():>12.3g}" for impl in impls)
        lines.append(f"{i:>5}  {token!r:<8}{cells}{marker}")
    if report.mask_held:
        verdict = (
            f"mask held: positions 0-{t - 1} are unchanged on {' and '.join(impls)}, "
            f"positions {t}-{len(tokens) - 1} {'changed' if report.information_flows else 'mostly changed'}"
        )
    else:
        leaks = {impl: int((c[:t] != 0).sum()) for impl, c in report.changes.items()}
        verdict = "MASK LEAKED: earlier positions changed (" + ", ".join(f"{k}: {v}" for k, v in leaks.items()) + ")"
    lines.append(verdict)
    return "\n".join(lines)
