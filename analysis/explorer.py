"""The attention explorer: DIR/index.html, one self-contained page (inline script, style and data; no network, no
server) to point at a token and see where it looks, flip through layers and heads, and step through generation.

The page's code is analysis/explorer_page.html; this module fills in its data, and owns the format: one JSON
object in <script id="explorer-data" type="application/json">, read by the page's script:

    version      1
    title        str: what was sampled (shown as the page's title)
    tokens       [str], T of them: the sequence the maps show (the first sample, its last block_size tokens)
    nPrompt      int: how many of them the decode steps ran as the prompt (one pass)
    nLayer, nHead, T
    windows      [int | null] per layer: a sliding window, or null for full causal attention. The mask follows:
                 query i may attend to keys lo(i) .. i, lo(i) = max(0, i - window + 1) (0 without a window)
    weights      base64 of uint8 cells: for each layer, each head, each query row i, the keys lo(i) .. i in
                 order (only the cells the mask allows; every other cell is exactly 0). A weight w is stored as
                 q = round(255 w), but a non-zero w as at least 1: q = 0 only for an exact 0; the page shows q / 255
    steps        null, or {first, weights}: the KV-cache decode steps of tokens first .. T - 1, the weights each
                 step used over its cached keys, packed like `weights` but with rows first .. T - 1 only
    diagnostics  {names: [str], values: (n_layer, n_head, len(names)) nested lists, null for an undefined value}
    causality    null, or {tokens: [str], position: int, changes: {attn_impl: [float] per position}, verdict: str}
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

import numpy as np

from analysis.causality import CausalityReport, verdict
from analysis.decode_steps import decode_step_weights
from analysis.diagnostics import DIAGNOSTIC_NAMES
from model import GPT

PAGE = Path(__file__).with_name("explorer_page.html")
DATA_SLOT = "__EXPLORER_DATA__"
TITLE_SLOT = "__EXPLORER_TITLE__"


def quantise(weights: np.ndarray) -> np.ndarray:
    """uint8 round(255 w), with any non-zero weight at least 1 so that 0 means exactly 0 (masked)."""
    q = np.rint(np.asarray(weights, dtype=np.float64) * 255).clip(0, 255).astype(np.uint8)
    q[(q == 0) & (np.asarray(weights) > 0)] = 1
    return q


def pack(cells: np.ndarray, mask: np.ndarray) -> bytes:
    """cells (n_layer, n_head, rows, T) uint8, mask (n_layer, rows, T): the allowed cells of each layer, head
    and row in order, as the page reads them."""
    n_layer, n_head = cells.shape[:2]
    return b"".join(cells[layer, head][mask[layer]].tobytes() for layer in range(n_layer) for head in range(n_head))


def unpack(data: bytes, mask: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of pack, dequantised: (n_layer, n_head, rows, T) float32, 0 where the mask forbids."""
    n_layer, rows, T = mask.shape
    out = np.zeros((n_layer, n_head, rows, T), dtype=np.float32)
    flat = np.frombuffer(data, dtype=np.uint8)
    start = 0
    for layer in range(n_layer):
        n = int(mask[layer].sum())
        for head in range(n_head):
            out[layer, head][mask[layer]] = flat[start : start + n] / 255
            start += n
    return out


def causality_data(report: CausalityReport, tokens: list[str]) -> dict:
    """The chart's data: per-position largest |change| of the logits on each path, and the verdict line."""
    changes = {impl: [float(x) for x in change] for impl, change in report.changes.items()}
    return {"tokens": tokens, "position": report.position, "changes": changes, "verdict": verdict(report)}


def page_data(
    title: str,
    tokens: list[str],
    weights: np.ndarray,
    mask: np.ndarray,
    windows: list[int | None],
    diagnostics: np.ndarray,
    steps: np.ndarray | None = None,
    causality: dict | None = None,
) -> dict:
    """The page's JSON (the module docstring): weights (n_layer, n_head, T, T) and mask (n_layer, T, T) as in
    attention.npz; steps (n_steps, n_layer, n_head, T) from decode_step_weights, for the last n_steps tokens."""
    n_layer, n_head, T, _ = weights.shape
    values = [[[None if math.isnan(v) else float(v) for v in head] for head in layer] for layer in diagnostics]
    data: dict = {
        "version": 1,
        "title": title,
        "tokens": tokens,
        "nPrompt": T if steps is None else T - len(steps),
        "nLayer": n_layer,
        "nHead": n_head,
        "T": T,
        "windows": list(windows),
        "weights": base64.b64encode(pack(quantise(weights), mask)).decode("ascii"),
        "steps": None,
        "diagnostics": {
            "names": list(DIAGNOSTIC_NAMES),
            "values": values,
        },
        "causality": causality,
    }
    if steps is not None and len(steps):
        first = T - len(steps)
        cells = quantise(steps).transpose(1, 2, 0, 3)  # (n_layer, n_head, n_steps, T): rows first .. T - 1
        data["steps"] = {"first": first, "weights": base64.b64encode(pack(cells, mask[:, first:])).decode("ascii")}
    return data


def write_page(data: dict, path: Path) -> Path:
    """Fill the page with `data`. The JSON is ASCII with <, > and & escaped, so no token can end the script."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = PAGE.read_text(encoding="utf-8")
    page = page.replace(TITLE_SLOT, html.escape(data["title"])).replace(DATA_SLOT, text)
    path.write_text(page, encoding="utf-8")
    return path


def save_explorer(
    model: GPT,
    ids: list[int],
    n_prefill: int,
    out_dir: Path,
    title: str,
    causality: dict | None = None,
) -> Path:
    """Write out_dir/index.html for the sequence whose attention.npz save_attention_maps wrote there (so the page
    holds those very numbers), with the decode steps of tokens n_prefill .. len(ids) - 1."""
    saved = np.load(out_dir / "attention.npz")
    steps = decode_step_weights(model, ids, n_prefill) if n_prefill < len(ids) else None
    data = page_data(
        title,
        [str(t) for t in saved["tokens"]],
        saved["weights"],
        saved["mask"],
        model.config.layer_windows(),
        saved["diagnostics"],
        steps,
        causality,
    )
    return write_page(data, out_dir / "index.html")
