"""eval.py: sliding-window loss, perplexity and bits per byte against straightforward references (the training
loop's full-split val loss, a per-token loop, Hugging Face's own loss), HellaSwag against a per-example loop, and
HellaSwag during training. Offline: the HellaSwag examples are written here."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.config import typed_config
from common.errors import ConfigError, DataError, UserError
from common.files import CKPT_NAME
from common.runtime import World, make_runtime
from conftest import (
    TINY_BPE,
    compose_config,
    refused,
    run_in_process,
    run_script,
    tiny_encoding,
    tiny_run_overrides,
)
from data.prepare import DataConfig, ensure_prepared
from data.tokenizers import BpeTokenizer
from eval import EvalConfig
from evals.hellaswag import Example, ending_scores, hellaswag_path, hellaswag_sums, load_examples
from evals.perplexity import score_sequences, windows
from inference.eval_run import run_eval
from model import GPT, GPTConfig
from model.checkpoint import load_checkpoint
from train import TrainConfig, TrainRunConfig, train
from training.trainer import Evaluator, split_across_ranks

HELLASWAG = [
    ("The chef cracks two eggs into a bowl and", ["whisks them.", "sings a song.", "paints the wall.", "the end."], 0),
    ("A man is standing on a ladder. He", ["climbs up.", "eats the ladder and the house", "is a fish.", "runs."], 3),
    ("On a long and quiet afternoon, the old woman in the red house near the river sat down by the window, took "
     "out her knitting and then, after a while, she", ["fell asleep.", "and the cat.", "knitted a scarf.", "th"], 2),
    ("Two dogs run in the park. They", ["chase a ball.", "fly.", "read a book about the sea.", "and"], 1),
    ("She opens the door and", ["walks in.", "the the the", "closes it again behind her.", "ou"], 0),
]


def _write_hellaswag(path: Path) -> Path:
    """The validation set's format: one JSON object a line, with more keys than the scorer reads."""
    lines = [json.dumps({"ind": i, "ctx": ctx, "ctx_a": ctx, "ctx_b": "", "endings": endings, "label": label})
             for i, (ctx, endings, label) in enumerate(HELLASWAG)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _random_gpt(vocab_size: int, block_size: int, seed: int = 0) -> GPT:
    """Weights large enough that the logits differ clearly between tokens and positions."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0)
    return model.eval()


def _nats(model: torch.nn.Module, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits, _ = model(torch.tensor([context]))
    return F.cross_entropy(logits[0, -1].double(), torch.tensor(target)).item()


@pytest.mark.parametrize("n_tokens", [1, 2, 5, 17, 18, 40, 101])
@pytest.mark.parametrize(("context", "stride"), [(16, 16), (16, 5), (16, 1), (4, 3)])
def test_windows_score_every_target_exactly_once(n_tokens: int, context: int, stride: int) -> None:
    scored = []
    found = list(windows(n_tokens, context, stride))
    for w in found:
        assert w.length == min(context, n_tokens - 1) and 1 <= w.scored <= w.length
        assert w.start + w.length <= n_tokens - 1  # its targets exist
        scored += range(w.start + w.length - w.scored + 1, w.start + w.length + 1)  # token indices of its targets
    assert scored == list(range(1, n_tokens))  # every token but the first, once each, in order
    assert all(w.scored == stride for w in found[1:-1])  # the first scores all its targets, the last the rest


def test_stride_1_gives_every_token_the_whole_context_and_bits_per_byte_leave_special_tokens_out() -> None:
    """stride=1 is the per-token definition: token j predicted from the min(j, context) tokens before it. As the
    training loop's val_bpb, <|endoftext|> counts no bytes and its nats are left out of bpb (not out of the loss)."""
    tokenizer = BpeTokenizer(tiny_encoding())
    eot = tokenizer.encoding.eot_token
    tokens = np.array([*tokenizer.encode(" the cat" * 5), eot, *tokenizer.encode(" and the dog" * 5)], dtype=np.int64)
    model = _random_gpt(tokenizer.vocab_size, block_size=8)
    byte_lengths = torch.from_numpy(tokenizer.token_byte_lengths()).double()
    score = score_sequences(model, [tokens], byte_lengths, 8, 1, batch_size=7)
    nats = [_nats(model, tokens[max(0, j - 8) : j].tolist(), int(tokens[j])) for j in range(1, len(tokens))]
    text_nats = sum(n for n, t in zip(nats, tokens[1:], strict=True) if t != eot)
    text_bytes = len(b" the cat" * 5 + b" and the dog" * 5) - len(tokenizer.decode([int(tokens[0])]).encode())
    assert len(tokens) > 16 and (score.tokens, score.bytes) == (len(tokens) - 1, text_bytes)
    assert score.loss == pytest.approx(sum(nats) / (len(tokens) - 1), rel=1e-6)
    assert score.bpb == pytest.approx(text_nats / (math.log(2) * text_bytes), rel=1e-6)


def test_eval_py_with_disjoint_windows_is_the_training_loops_full_val_loss(trained_run: Path, tmp_path: Path) -> None:
    """stride=block_size on the run's own val split: every_window's windows (train.full_val), plus the tail they
    leave out, scored once with the last block_size tokens. The last stdout line is the JSON record. eval.py as its
    own process, the suite's one: all that a whole command writes."""
    result = run_script("eval.py", [f"out_dir={trained_run}", "stride=32", "device=cpu"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    *lines, last = result.stdout.strip().splitlines()
    record = json.loads(last)
    assert lines and "perplexity" in lines[-1] and not list(tmp_path.iterdir())  # eval.py writes nothing
    assert (record["context"], record["stride"]) == (32, 32) and "val split" in record["input"]

    checkpoint = load_checkpoint(trained_run / CKPT_NAME)
    model = checkpoint.build_model().eval()
    data = ensure_prepared(DataConfig(**checkpoint.config["data"]), prepare=False)
    train = TrainConfig(full_val=True, eval_iters=1, batch_size=8)
    ones = torch.ones(checkpoint.model_config.vocab_size, dtype=torch.float64)  # characters: a byte each (ASCII)
    evaluator = Evaluator(data, train, 0, 32, ones, make_runtime("cpu", "float32"), World())
    full_val = evaluator(model).val
    val = data.val.open(0)
    targets = len(val) - 1
    covered = targets // 32 * 32  # every_window's targets
    tail = targets - covered
    tail_nats = 0.0
    if tail:
        with torch.no_grad():
            logits, _ = model(torch.from_numpy(val[-33:-1].astype(np.int64))[None])
        y = torch.from_numpy(val[-tail:].astype(np.int64))
        tail_nats = F.cross_entropy(logits[0, -tail:].double(), y, reduction="sum").item()
    assert record["tokens"] == targets
    assert record["loss"] == pytest.approx((full_val * covered + tail_nats) / targets, rel=1e-5)
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]), rel=1e-9)


def test_bits_per_byte_of_ascii_text_on_a_char_model(trained_run: Path, tmp_path: Path, corpus_path: Path) -> None:
    text = "".join(c for c in corpus_path.read_text(encoding="utf-8")[:3000] if c.isascii())  # a byte each
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    record = run_eval(EvalConfig(out_dir=str(trained_run), input=str(tmp_path / "text.txt"), device="cpu"), False)
    assert record["tokens"] == record["bytes"] == len(text) - 1  # the first character has no context: not scored
    assert (record["context"], record["stride"]) == (32, 16)  # the defaults: the model's block_size, half of it
    assert record["bpb"] == pytest.approx(record["loss"] / math.log(2), rel=1e-9)


def test_init_from_an_hf_directory_gives_hfs_own_loss_and_hellaswag(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hugging Face's perplexity guide, verbatim: windows of max_length = context + 1 tokens advancing by stride,
    each scoring (labels, shifted by HF) the tokens the previous one didn't. The text is cut so that its last
    window ends where the text does, as eval.py's does."""
    monkeypatch.setattr("inference.sampling.GPT2_ENCODING", TINY_BPE)  # GPT-2's BPE stands in offline
    encoding = tiny_encoding()
    from transformers import GPT2Config, GPT2LMHeadModel  # seconds to import: only in this test

    config = GPT2Config(vocab_size=encoding.n_vocab, n_positions=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(3)
    hf_model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    context, stride = 63, 16
    text = corpus_path.read_text(encoding="utf-8")[:1000]
    while (len(encoding.encode_ordinary(text)) - (context + 1)) % stride:
        text = text[:-1]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    cfg = EvalConfig(init_from=str(hf_dir), input=str(tmp_path / "text.txt"), context=context, stride=stride,
                     batch_size=3, hellaswag=True, hellaswag_file=str(_write_hellaswag(tmp_path / "hs.jsonl")),
                     device="cpu")
    record = run_eval(cfg, progress=False)
    ids = torch.tensor([encoding.encode_ordinary(text)])
    seq_len, nll_sum, n_tokens, prev_end = ids.size(1), 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + context + 1, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(input_ids, labels=labels).loss
        scored = (labels[:, 1:] != -100).sum().item()
        nll_sum, n_tokens, prev_end = nll_sum + loss.item() * scored, n_tokens + scored, end
        if end == seq_len:
            break
    assert record["tokens"] == n_tokens == seq_len - 1
    assert record["loss"] == pytest.approx(nll_sum / n_tokens, abs=1e-5)

    examples = load_examples(Path(cfg.hellaswag_file), BpeTokenizer(encoding))
    correct = _reference_hellaswag(hf_model, examples, block_size=64)[0]
    assert (record["hellaswag_acc"], record["hellaswag_acc_norm"], record["hellaswag_examples"]) == (
        correct[0] / len(HELLASWAG), correct[1] / len(HELLASWAG), len(HELLASWAG))


def _reference_hellaswag(model: torch.nn.Module, examples: list[Example], block_size: int) -> tuple[list, list]:
    """One ending at a time: context + ending cut to its last block_size + 1 tokens, log_softmax, the ending's
    tokens picked out. (correct by sum, correct by mean) and each example's (sums, means)."""
    correct, scores = [0, 0], []
    for example in examples:
        sums, means = [], []
        for ending in example.endings:
            row = (example.context + ending)[-(block_size + 1) :]
            with torch.no_grad():
                out = model(torch.tensor([row[:-1]]))
            logits = out.logits if hasattr(out, "logits") else out[0]
            log_probs = torch.log_softmax(logits[0].double(), dim=-1)
            n = min(len(ending), len(row) - 1)
            picked = [log_probs[i, row[i + 1]].item() for i in range(len(row) - 1 - n, len(row) - 1)]
            sums.append(sum(picked))
            means.append(sum(picked) / n)
        correct[0] += int(np.argmax(sums)) == example.label
        correct[1] += int(np.argmax(means)) == example.label
        scores.append((sums, means))
    return correct, scores


def test_hellaswag_scores_equal_a_per_ending_loop(tmp_path: Path) -> None:
    """Block size 24: the long example's context loses its first tokens, in both."""
    tokenizer = BpeTokenizer(tiny_encoding())
    examples = load_examples(_write_hellaswag(tmp_path / "hs.jsonl"), tokenizer)
    assert len(examples[2].context) + max(map(len, examples[2].endings)) > 25  # it is cropped
    model = _random_gpt(tokenizer.vocab_size, block_size=24, seed=1)
    correct, scores = _reference_hellaswag(model, examples, block_size=24)
    for example, (sums, means) in zip(examples, scores, strict=True):
        got_sums, got_means = ending_scores(model, example, 24, torch.device("cpu"))
        # float32 log-probabilities summed two ways: equal to float32's precision (a sum of ~-30 to about 1e-6)
        torch.testing.assert_close(got_sums, torch.tensor(sums, dtype=torch.float64), atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got_means, torch.tensor(means, dtype=torch.float64), atol=1e-5, rtol=1e-6)
    one = hellaswag_sums(model, ((e, True) for e in examples), 24, torch.device("cpu"))
    assert one.tolist() == [*correct, len(examples)]
    # Two ranks, each its share (split_across_ranks, as training does): the same sums, the same number of passes each.
    shares = [list(split_across_ranks(((e,) for e in examples), World(rank=r, size=2))) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 3
    assert sum(hellaswag_sums(model, share, 24, torch.device("cpu")) for share in shares).tolist() == one.tolist()


def test_hellaswag_file_errors_are_one_line_and_a_download_cut_short_is_not_kept(tmp_path: Path) -> None:
    import http.server
    import threading

    with pytest.raises(DataError, match=r"could not download http://127\.0\.0\.1:9/hs\.jsonl .*hellaswag_file=PATH"):
        hellaswag_path(None, "hellaswag_file", tmp_path / "cache" / "hs.jsonl", url="http://127.0.0.1:9/hs.jsonl")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half written
    with pytest.raises(DataError, match=r"hellaswag_file=.*none\.jsonl does not exist; name a HellaSwag \.jsonl"):
        hellaswag_path(str(tmp_path / "none.jsonl"), "hellaswag_file")
    cached = _write_hellaswag(tmp_path / "cached.jsonl")
    assert hellaswag_path(None, "hellaswag_file", cached, url="http://127.0.0.1:9/x") == cached  # no download
    (tmp_path / "bad.jsonl").write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1 is not a HellaSwag example"):
        load_examples(tmp_path / "bad.jsonl", BpeTokenizer(tiny_encoding()))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"ctx": "caf\xe9"}\n')  # for eval.py and train.hellaswag_file alike
    with pytest.raises(DataError, match=r"latin1\.jsonl is not UTF-8 text"):
        load_examples(tmp_path / "latin1.jsonl", BpeTokenizer(tiny_encoding()))

    class Short(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b'{"ctx": "a"')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Short)  # it promises more bytes than it sends
    threading.Thread(target=server.handle_request, daemon=True).start()
    cached = tmp_path / "cache2" / "hs.jsonl"
    try:
        with pytest.raises(DataError, match="could not download .*hellaswag_file=PATH"):
            hellaswag_path(None, "hellaswag_file", cached, url=f"http://127.0.0.1:{server.server_port}/hs.jsonl")
    finally:
        server.server_close()
    assert not cached.exists() and not any(cached.parent.iterdir())  # no cached copy to trust next time


def test_eval_mistakes_are_one_line(trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="^stride=0 must be >= 1; null means half the context$"):
        EvalConfig(out_dir="run", stride=0)
    with pytest.raises(ConfigError, match="hellaswag_file=hs.jsonl is read only with hellaswag=true"):
        EvalConfig(out_dir="run", hellaswag_file="hs.jsonl")
    with pytest.raises(ConfigError, match="init_from=gpt2 has no val split to score: pass input=FILE"):
        typed_config(compose_config(["init_from=gpt2"], config_name="eval"), EvalConfig)
    mistakes = [
        ({"stride": 33}, r"stride=33 must be in \[1, 32\]"),
        ({"context": 64}, "context=64 exceeds the model's block_size=32"),
        ({"input": str(tmp_path)}, "is not a file"),
    ]
    for keys, message in mistakes:
        with pytest.raises(UserError, match=message) as info:
            run_eval(EvalConfig(out_dir=str(trained_run), device="cpu", **keys), progress=False)
        assert "\n" not in str(info.value)
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: pytest.fail("downloaded for a char model"))
    result = run_in_process("eval.py", [f"out_dir={trained_run}", "hellaswag=true"], tmp_path)
    assert refused(result).startswith("error: HellaSwag needs a BPE model") and result.stdout == ""


def test_train_hellaswag_every_writes_accuracy_at_its_evaluations(tmp_path: Path, corpus_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    hellaswag = _write_hellaswag(tmp_path / "hs.jsonl")
    text = tmp_path / "text.txt"  # a short text: BPE-encoding the whole corpus would take most of the test's time
    text.write_text(corpus_path.read_text(encoding="utf-8")[:50_000], encoding="utf-8")
    extra = {"data.tokenizer": TINY_BPE, "train.hellaswag_every": 20, "train.hellaswag_file": hellaswag,
             "train.max_iters": 20, "train.eval_interval": 10}
    with caplog.at_level(logging.INFO, logger="train"):
        train(compose_config(tiny_run_overrides(tmp_path, text, **extra)))
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "val_loss" in r]
    assert [(r["iter"], "hellaswag_acc" in r) for r in evals] == [(0, True), (10, False), (20, True)]
    said = [m for m in caplog.messages if m.startswith("step ")]
    assert said == [f"step {r['iter']}: train loss {r['train_loss']:.4f}, val loss {r['val_loss']:.4f}, val "
                    f"{r['val_bpb']:.4f} bits/byte" + (f", hellaswag acc {r['hellaswag_acc']:.4f} (acc_norm "
                    f"{r['hellaswag_acc_norm']:.4f})" if "hellaswag_acc" in r else "") for r in evals]
    model = load_checkpoint(tmp_path / "run" / CKPT_NAME).build_model().eval()  # iter 20's weights
    examples = load_examples(hellaswag, BpeTokenizer(tiny_encoding()))
    correct, correct_norm, count = hellaswag_sums(model, ((e, True) for e in examples), 32, torch.device("cpu"))
    assert (evals[-1]["hellaswag_acc"], evals[-1]["hellaswag_acc_norm"]) == (correct / count, correct_norm / count)


def test_train_hellaswag_every_is_refused_for_char_data_and_off_the_evaluations() -> None:
    with pytest.raises(ConfigError, match="train.hellaswag_every=10 needs a BPE model"):
        typed_config(compose_config(["train.hellaswag_every=10", "train.eval_interval=10"]), TrainRunConfig)
    overrides = ["data=shakespeare", "train.hellaswag_every=15", "train.eval_interval=10"]
    with pytest.raises(ConfigError, match="train.hellaswag_every=15 is not a multiple of train.eval_interval=10"):
        typed_config(compose_config(overrides), TrainRunConfig)
    with pytest.raises(ConfigError, match="train.hellaswag_file=hs.jsonl is read only with train.hellaswag_every"):
        TrainConfig(hellaswag_file="hs.jsonl")
