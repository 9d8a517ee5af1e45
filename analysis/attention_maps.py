"""Attention weights of a trained model, saved as numbers (attention.npz) and pictures (one PNG per layer, a heat map
per head: row i is query i, column j key j, a row sums to 1). Masked cells, exactly 0, are grey; small weights black."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from analysis.diagnostics import DIAGNOSTIC_NAMES, head_diagnostics
from common.errors import DataError
from common.files import write_atomically
from model import GPT, causal_mask

EXPLORER_MARK = "<!-- The attention explorer."  # the first comment of analysis/explorer_page.html
OURS = re.compile(r"attention\.npz|index\.html|attention_layer\d+\.png")  # every file sample.py writes there
LABELS_UP_TO = 48  # token labels on the axes only while they stay readable


def save_attention_maps(model: GPT, ids: list[int], tokens: list[str], out_dir: Path) -> list[Path]:
    """Write out_dir/attention.npz (weights (n_layer, n_head, T, T); mask (n_layer, T, T), True where a query may
    attend; tokens; diagnostics (n_layer, n_head, 5), named by diagnostic_names) and a PNG per layer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights, mask = attention_arrays(model, ids)
    arrays = dict(weights=weights, mask=mask, tokens=np.array(tokens), diagnostics=head_diagnostics(model, weights),
                  diagnostic_names=np.array(DIAGNOSTIC_NAMES))
    write_atomically(out_dir / "attention.npz", lambda f: np.savez(f, **arrays))
    return [_plot_layer(weights[layer], mask[layer], tokens, layer, out_dir) for layer in range(len(weights))]


def attention_arrays(model: GPT, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The math path's weights, float32 (n_layer, n_head, T, T), and the mask, bool (n_layer, T, T)."""
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    weights = model.attention_weights(idx)[:, 0].float().cpu().numpy()
    mask = np.stack([causal_mask(len(ids), len(ids), window=w).numpy() for w in model.config.layer_windows()])
    return weights, mask


def check_output_dir(out_dir: Path) -> None:
    """Before any work: DataError unless out_dir is new, empty or holds only what an earlier attention_dir wrote."""
    if not out_dir.is_dir():
        return
    strangers = [p.name for p in sorted(out_dir.iterdir()) if not OURS.fullmatch(p.name) or not p.is_file()]
    page = out_dir / "index.html"
    if page.is_file() and EXPLORER_MARK not in page.read_text(encoding="utf-8", errors="replace")[:1000]:
        strangers.append("index.html (not an attention explorer page)")
    if strangers:
        raise DataError(f"attention_dir={out_dir} holds files sample.py didn't write ({', '.join(strangers[:3])}); "
                        "name an empty or new directory, so nothing of yours is overwritten")


def _plot_layer(weights: np.ndarray, mask: np.ndarray, tokens: list[str], layer: int, out_dir: Path) -> Path:
    from matplotlib import colormaps
    from matplotlib.colors import PowerNorm
    from matplotlib.figure import Figure  # outside pyplot: files only, no display

    n_head, T, _ = weights.shape
    cols = min(n_head, 4)
    rows = -(-n_head // cols)
    size = 3.2 if T <= LABELS_UP_TO // 2 else 4.2
    fig = Figure(figsize=(size * cols + 1, size * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # stretch small weights; 0 stays black
    cmap = colormaps["inferno"].with_extremes(bad="#9a9a9a")  # "bad", the masked cells: grey, no weight's colour
    labels = [t.replace("\n", "\\n").replace(" ", "\u2423") or "\u2205" for t in tokens]
    for ax in axes.flat[n_head:]:
        ax.axis("off")
    for head, ax in enumerate(axes.flat[:n_head]):
        image = ax.imshow(np.ma.masked_array(weights[head], mask=~mask), cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(f"head {head}", fontsize=9)
        if T <= LABELS_UP_TO:
            ax.set_xticks(range(T), labels, rotation=90, fontsize=6, family="monospace")
            ax.set_yticks(range(T), labels, fontsize=6, family="monospace")
        else:
            ax.set_xlabel("key position", fontsize=8)
            ax.set_ylabel("query position", fontsize=8)
    fig.suptitle(f"layer {layer}: attention weights (rows: queries, columns: keys)", fontsize=10)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="weight (grey: masked, no weight)")
    path = out_dir / f"attention_layer{layer}.png"
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    return path
