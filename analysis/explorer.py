"""The attention explorer, DIR/index.html: analysis/explorer_page.html filled with one JSON object (its format:
docs/attention_explorer.md), a self-contained page showing where each token looks, per layer and head and through
generation."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import numpy as np

from analysis.attention_maps import attention_arrays
from analysis.causality import CausalityReport, verdict
from analysis.diagnostics import DIAGNOSTIC_NAMES, decode_step_weights, head_diagnostics
from common.files import METRICS_NAME, read_records, write_text_atomically
from model import GPT

PAGE = Path(__file__).with_name("explorer_page.html")


def quantise(weights: np.ndarray) -> np.ndarray:
    """uint8 ≈ 255 w, rows (last axis) rounded by largest remainder: a softmax row sums to exactly 255; 0 stays 0."""
    scaled = np.asarray(weights, dtype=np.float64).clip(0, 1) * 255
    q = np.floor(scaled)
    short = np.rint(scaled.sum(-1, keepdims=True)) - q.sum(-1, keepdims=True)  # units the floors lost, per row
    rank = np.argsort(np.argsort(q - scaled, axis=-1, kind="stable"), axis=-1)  # 0: the largest remainder
    return (q + (rank < short)).astype(np.uint8)


def causality_data(report: CausalityReport, tokens: list[str]) -> dict:
    """The chart's data: per-position largest |change| of the logits on each path, and the verdict line."""
    changes = {impl: [float(x) for x in change] for impl, change in report.changes.items()}
    return {"tokens": tokens, "position": report.position, "changes": changes, "verdict": verdict(report)}


def head_history(run: Path) -> dict | None:
    """The head scores the run logged at its evaluations (train.head_scores), for the open head's charts: {"iters",
    "scores": {name: per evaluation, n_layer x n_head nested lists}}; None when it logged none."""
    if not (run / METRICS_NAME).is_file():
        return None
    logged = [r for r in read_records(run)[0] if isinstance(r.get("heads"), dict)]
    if not logged:
        return None
    return {"iters": [r["iter"] for r in logged], "scores": {name: [r["heads"][name] for r in logged]
                                                             for name in logged[0]["heads"]}}


def page_data(title: str, tokens: list[str], weights: np.ndarray, mask: np.ndarray, windows: list[int | None],
              diagnostics: np.ndarray, steps: np.ndarray | None = None, causality: dict | None = None,
              steps_note: str | None = None, context_note: str | None = None, history: dict | None = None) -> dict:
    """The page's JSON (module docstring): weights and mask as in attention.npz, steps as from decode_step_weights,
    history as from head_history."""
    n_layer, n_head, T, _ = weights.shape
    matrix = quantise(weights)
    packed = b"".join(matrix[layer, head][mask[layer]].tobytes() for layer in range(n_layer) for head in range(n_head))
    values = [[[None if math.isnan(v) else float(v) for v in head] for head in layer] for layer in diagnostics]
    data: dict = {
        "version": 1, "title": title, "tokens": tokens, "nPrompt": T if steps is None else T - len(steps),
        "nLayer": n_layer, "nHead": n_head, "T": T, "windows": list(windows),
        "weights": base64.b64encode(packed).decode("ascii"), "steps": None,
        "diagnostics": {"names": list(DIAGNOSTIC_NAMES), "values": values}, "causality": causality,
        "stepsNote": steps_note, "contextNote": context_note, "history": history,
    }
    if steps is not None and len(steps):
        n_steps = len(steps)
        first = T - n_steps
        cells = quantise(steps).transpose(1, 2, 0, 3).reshape(-1, T)  # rows in (layer, head, step) order
        differ = np.flatnonzero((cells != matrix[:, :, first:].reshape(-1, T)).any(axis=-1))
        rows = b"".join(cells[i][mask[i // n_steps // n_head, first + i % n_steps]].tobytes() for i in differ)
        data["steps"] = {"first": first, "differ": differ.tolist(), "weights": base64.b64encode(rows).decode("ascii")}
    return data


def render_page(data: dict) -> str:
    """The page filled with `data`. The JSON is ASCII with <, > and & escaped, so no token can end the script."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    slots = {"__EXPLORER_TITLE__": html.escape(data["title"]), "__EXPLORER_DATA__": text}
    return re.sub("|".join(slots), lambda m: slots[m.group(0)], PAGE.read_text(encoding="utf-8"))  # one pass


def live_page(model: GPT, ids: list[int], tokens: list[str], n_prompt: int, title: str,
              induction: np.ndarray | None = None, context_note: str | None = None, causality: dict | None = None,
              use_cache: bool = True, saved: np.lib.npyio.NpzFile | None = None, history: dict | None = None) -> str:
    """The page for a sequence in memory (serve.py's live page; save_explorer writes one): its last block_size tokens,
    tokens[i] the text of ids[i], with the decode steps of those after n_prompt where generation took them. `saved`:
    that window's attention.npz, whose weights, mask and diagnostics are then not computed again."""
    config = model.config
    T = min(len(ids), config.block_size)
    weights, mask = (saved["weights"], saved["mask"]) if saved is not None else attention_arrays(model, ids[-T:])
    steps, note = None, None
    if not use_cache:
        note = "Sampled with use_cache=false: every step recomputed its window, so there are no decode steps to show."
    elif len(ids) > n_prompt and (config.rolls or len(ids) <= config.block_size):  # a cache runs past it if it rolls
        steps = decode_step_weights(model, ids, n_prompt, T)
    elif len(ids) > n_prompt:
        grew = "prompt is" if n_prompt > config.block_size else "sample grew"
        note = (f"The {grew} longer than block_size={config.block_size}: past it, generation recomputed each cropped "
                "window without the KV cache, so there are no decode steps to show for this window.")
    diagnostics = saved["diagnostics"] if saved is not None else head_diagnostics(model, weights, induction)
    return render_page(page_data(title, tokens[-T:], weights, mask, config.layer_windows(), diagnostics, steps,
                                 causality, note, context_note, history))


def save_explorer(model: GPT, sample: list[int], n_prompt: int, out_dir: Path, title: str,
                  causality: dict | None = None, use_cache: bool = True, history: dict | None = None) -> Path:
    """Write out_dir/index.html beside the attention.npz of `sample`'s last window (save_attention_maps)."""
    with np.load(out_dir / "attention.npz") as saved:
        page = live_page(model, sample, [str(t) for t in saved["tokens"]], n_prompt, title, causality=causality,
                         use_cache=use_cache, saved=saved, history=history)
    path = out_dir / "index.html"
    write_text_atomically(path, page)
    return path
