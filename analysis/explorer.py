"""The attention explorer, DIR/index.html: analysis/explorer_page.html, self-contained, showing where each token
looks, per layer and head and through generation. Its data: one JSON object in <script id="explorer-data" ...>:

    version      1
    title        str: what was sampled (shown as the page's title)
    tokens       [str], T of them: the sequence the maps show (the first sample, its last block_size tokens)
    nPrompt      int: how many of them the decode steps ran as the prompt (one pass)
    nLayer, nHead, T
    windows      [int | null] per layer: query i attends to keys lo(i) .. i, lo(i) = max(0, i - window + 1) (0: null)
    weights      base64 of uint8 cells q ≈ 255 w (quantise): for each layer, head and query row i, the keys lo(i) .. i
    steps        null, or {first, differ, weights}: the KV-cache decode steps' weights for tokens first .. T - 1, stored
                 only where a row differs from the matrix's row t once quantised: `differ` lists those rows, ascending,
                 as (layer * nHead + head) * (T - first) + (t - first); `weights` their allowed cells, packed likewise
    diagnostics  {names: [str], values: (n_layer, n_head, len(names)) nested lists, null for an undefined value}
    stepsNote    null, or str: why there are no steps (the sample outgrew block_size, or use_cache=false)
    contextNote  null, or str: that the tokens are the last block_size of a longer text (shown under the title)
    causality    null, or {tokens: [str], position: int, changes: {attn_impl: [float] per position}, verdict: str}
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import numpy as np

from analysis.attention_maps import attention_arrays, load_attention_maps
from analysis.causality import CausalityReport, verdict
from analysis.diagnostics import DIAGNOSTIC_NAMES, decode_step_weights, head_diagnostics, run_to_end
from model import GPT

PAGE = Path(__file__).with_name("explorer_page.html")
DATA_SLOT = "__EXPLORER_DATA__"
TITLE_SLOT = "__EXPLORER_TITLE__"


def quantise(weights: np.ndarray) -> np.ndarray:
    """uint8 ≈ 255 w, rows (last axis) rounded by largest remainder: a softmax row sums to exactly 255; 0 stays 0."""
    scaled = np.asarray(weights, dtype=np.float64).clip(0, 1) * 255
    q = np.floor(scaled)
    short = np.rint(scaled.sum(-1, keepdims=True)) - q.sum(-1, keepdims=True)  # units the floors lost, per row
    rank = np.argsort(np.argsort(q - scaled, axis=-1, kind="stable"), axis=-1)  # 0: the largest remainder
    return (q + (rank < short)).astype(np.uint8)


def pack(cells: np.ndarray, mask: np.ndarray) -> bytes:
    """The allowed cells of each layer, head and row of cells (n_layer, n_head, rows, T), in the page's order."""
    n_layer, n_head = cells.shape[:2]
    return b"".join(cells[layer, head][mask[layer]].tobytes() for layer in range(n_layer) for head in range(n_head))


def causality_data(report: CausalityReport, tokens: list[str]) -> dict:
    """The chart's data: per-position largest |change| of the logits on each path, and the verdict line."""
    changes = {impl: [float(x) for x in change] for impl, change in report.changes.items()}
    return {"tokens": tokens, "position": report.position, "changes": changes, "verdict": verdict(report)}


def page_data(title: str, tokens: list[str], weights: np.ndarray, mask: np.ndarray, windows: list[int | None],
              diagnostics: np.ndarray, steps: np.ndarray | None = None, causality: dict | None = None,
              steps_note: str | None = None, context_note: str | None = None) -> dict:
    """The page's JSON (module docstring): weights and mask as in attention.npz, steps as from decode_step_weights."""
    n_layer, n_head, T, _ = weights.shape
    matrix = quantise(weights)
    values = [[[None if math.isnan(v) else float(v) for v in head] for head in layer] for layer in diagnostics]
    data: dict = {
        "version": 1, "title": title, "tokens": tokens, "nPrompt": T if steps is None else T - len(steps),
        "nLayer": n_layer, "nHead": n_head, "T": T, "windows": list(windows),
        "weights": base64.b64encode(pack(matrix, mask)).decode("ascii"), "steps": None,
        "diagnostics": {"names": list(DIAGNOSTIC_NAMES), "values": values}, "causality": causality,
        "stepsNote": steps_note, "contextNote": context_note,
    }
    if steps is not None and len(steps):
        first = T - len(steps)
        cells = np.ascontiguousarray(quantise(steps).transpose(1, 2, 0, 3))  # (n_layer, n_head, n_steps, T)
        differ = np.flatnonzero((cells != matrix[:, :, first:]).any(axis=-1))
        n_steps = T - first
        flat = cells.reshape(-1, T)
        rows = [flat[i][mask[i // n_steps // n_head, first + i % n_steps]] for i in differ]
        packed = base64.b64encode(b"".join(row.tobytes() for row in rows)).decode("ascii")
        data["steps"] = {"first": first, "differ": differ.tolist(), "weights": packed}
    return data


def write_page(data: dict, path: Path) -> Path:
    path.write_text(render_page(data), encoding="utf-8")
    return path


def render_page(data: dict) -> str:
    """The page filled with `data`. The JSON is ASCII with <, > and & escaped, so no token can end the script."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    slots = {TITLE_SLOT: html.escape(data["title"]), DATA_SLOT: text}
    return re.sub("|".join(slots), lambda m: slots[m.group(0)], PAGE.read_text(encoding="utf-8"))  # one pass


def live_page(model: GPT, ids: list[int], tokens: list[str], n_prompt: int, title: str,
              induction: np.ndarray | None = None, context_note: str | None = None) -> str:
    """serve.py's live page for a sequence in memory: its last block_size tokens, with the generated ones' decode steps.
    tokens: each id's text; induction: induction_scores(model), if known; context_note: the cropped-context line."""
    config = model.config
    T = min(len(ids), config.block_size)
    weights, mask = attention_arrays(model, ids[-T:])
    steps = None
    if len(ids) > n_prompt and (config.rolls or len(ids) <= config.block_size):  # generated tokens, decoded cached
        steps = run_to_end(decode_step_weights(model, ids, n_prompt, last=T))
    diagnostics = head_diagnostics(model, weights, induction)
    return render_page(page_data(title, tokens[-T:], weights, mask, config.layer_windows(), diagnostics, steps,
                                 context_note=context_note))


def save_explorer(model: GPT, sample: list[int], n_prompt: int, out_dir: Path, title: str,
                  causality: dict | None = None, use_cache: bool = True) -> Path:
    """Write out_dir/index.html from its attention.npz, with the decode steps of `sample`'s tokens after n_prompt."""
    saved = load_attention_maps(out_dir)
    T, config = len(saved["tokens"]), model.config
    generated = min(T, len(sample) - n_prompt)
    steps, note = None, None
    if not use_cache:
        note = "Sampled with use_cache=false: every step recomputed its window, so there are no decode steps to show."
    elif generated > 0 and (config.rolls or len(sample) <= config.block_size):
        steps = run_to_end(decode_step_weights(model, sample, n_prompt, last=T))
    elif generated > 0:
        grew = "prompt is" if n_prompt > config.block_size else "sample grew"
        note = (f"The {grew} longer than block_size={config.block_size}: past it, generation recomputed each cropped "
                "window without the KV cache, so there are no decode steps to show for this window.")
    data = page_data(title, [str(t) for t in saved["tokens"]], saved["weights"], saved["mask"], config.layer_windows(),
                     saved["diagnostics"], steps, causality, note)
    return write_page(data, out_dir / "index.html")
