"""Generate text from a trained run, the samples drawn as one batch: `python sample.py --help` lists the keys."""

import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from common.config import (
    SEED_MAX,
    end_quietly_when_stdout_closes,
    keys_help,
    literal_text,
    option,
    run_hydra,
    typed_config,
)
from common.errors import ConfigError
from common.files import make_directory
from common.runtime import make_runtime
from inference.sampling import MAX_NEW_TOKENS, SEPARATOR, ModelChoice, Sampler, load_model, stop_strings, warn
from model.gpt import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, Decoding


@dataclass
class SampleConfig(ModelChoice):
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = option(3, at_least=1)  # samples drawn side by side (one when decoding is greedy)
    # tokens per sample, at most 1,000,000 (1e10 would run for days while its text filled memory)
    max_new_tokens: int = option(500, at_least=1, at_most=MAX_NEW_TOKENS)
    # logits divided by it: 0 is greedy (the most likely token), below 1 sharper, above 1 flatter
    temperature: float = option(DEFAULT_TEMPERATURE, at_least=0.0,
                                hint="0 means greedy decoding (the most likely token)")
    top_k: int | None = option(DEFAULT_TOP_K, at_least=1, hint="null means no cut-off")  # the k most likely tokens
    # nucleus sampling: the fewest most likely tokens holding probability top_p (of tied ones, the first by id); null:
    # no cut-off
    top_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")
    # the tokens at least min_p times as likely as the most likely one; null: no cut-off
    min_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)  # the same seed, the same samples
    use_cache: bool = True  # KV cache: run the prompt once, then one token per step
    # a sample ends before the first of these strings (\n, \t: newline, tab); BPE's <|endoftext|> too, unless stop=[]
    stop: list[str] | None = None
    stream: bool | None = None  # print each sample as it is generated; null: when stdout is a terminal
    # write attention.npz, one PNG per layer and index.html, the attention explorer, here
    attention_dir: str | None = option(None, path=True)
    check_causal: bool = False  # print the causality demonstration after the samples: a summary by range
    check_causal_positions: bool = False  # with check_causal: one line per position instead of the summary

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stop is not None and "" in self.stop:
            raise ConfigError(f"stop={self.stop} has an empty string, which would stop at once; remove it")


ConfigStore.instance().store(name="sample_schema", node=SampleConfig)



def main(dict_cfg: DictConfig) -> None:
    end_quietly_when_stdout_closes()
    cfg = typed_config(dict_cfg, SampleConfig)
    if cfg.attention_dir:  # before any work: nothing of the user's is overwritten
        from analysis.attention_maps import check_output_dir
        check_output_dir(Path(cfg.attention_dir))
        make_directory(Path(cfg.attention_dir), f"attention_dir={cfg.attention_dir}")  # a file there: one line
    runtime = make_runtime(cfg.device, cfg.dtype)
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    sampler = Sampler(loaded.model.to(runtime.device).eval(), loaded.tokenizer, runtime)
    prompt = sampler.encode_prompt(cfg.start)
    decoding = Decoding(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
    count = 1 if decoding.greedy else cfg.num_samples
    if count < cfg.num_samples:
        warn(f"greedy decoding: the {cfg.num_samples} samples would be the same text, so one is drawn")
    stream = sys.stdout.isatty() if cfg.stream is None else cfg.stream
    stop = stop_strings(cfg.stop, sampler.tokenizer)
    samples = sampler.generate(prompt, count, cfg.max_new_tokens, decoding, use_cache=cfg.use_cache, stop=stop,
                               stream=sys.stdout if stream else None, seed=cfg.seed)
    if not stream:
        sys.stdout.write("".join(sample.text + SEPARATOR for sample in samples))
    if cfg.attention_dir or cfg.check_causal:
        look_inside(cfg, sampler, samples[0].ids, len(prompt))


def look_inside(cfg: SampleConfig, sampler: Sampler, first: list[int], prompt_length: int) -> None:
    """check_causal and attention_dir, on the first sample (its prompt and continuation)."""
    decode_each = [sampler.tokenizer.decode([i]) for i in first]
    causality = None
    if cfg.check_causal:
        from analysis.causality import check_causality, format_report

        # A rolling model runs any length in one pass: enough that its receptive field's far edge shows.
        config = sampler.model.config
        span = max(config.block_size, 2 * config.receptive_field) if config.rolls else None
        window = sampler.last_window(first, "causality check", span)
        if len(window) < 2:
            warn("causality check: needs at least 2 tokens; raise max_new_tokens")
        elif config.vocab_size < 2:
            warn("causality check: could not run: a one-token vocabulary has no other token to change to")
        else:
            report = check_causality(sampler.model, window)
            changed_to = sampler.tokenizer.decode([(window[report.position] + 1) % config.vocab_size])
            tokens = decode_each[-len(window) :]
            print(format_report(report, tokens, changed_to, positions=cfg.check_causal_positions))
            causality = (report, tokens)
    if cfg.attention_dir:
        from analysis.attention_maps import save_attention_maps
        from analysis.explorer import causality_data, head_history, save_explorer

        out_dir = Path(cfg.attention_dir)
        window = sampler.last_window(first, "attention maps")
        paths = save_attention_maps(sampler.model, window, decode_each[-len(window) :], out_dir)
        title = f"{cfg.init_from if cfg.out_dir is None else cfg.out_dir}: {cfg.start!r}"
        history = None if cfg.out_dir is None else head_history(Path(cfg.out_dir))  # train.head_scores's
        page = save_explorer(sampler.model, first, prompt_length, out_dir, title,
                             None if causality is None else causality_data(*causality), use_cache=cfg.use_cache,
                             history=history)
        print(f"wrote {out_dir / 'attention.npz'}, {len(paths)} PNGs and {page}", file=sys.stderr)


def usage() -> str:
    """`python sample.py --help`: the keys set most; every key: docs/reference.md."""
    return f"""Generate text from a trained run. Settings are key=value, no dashes.

Keys set most, at their defaults:
{keys_help(SampleConfig, ("out_dir", "init_from", "start", "num_samples", "max_new_tokens", "temperature", "top_k",
                          "seed", "stop", "ckpt", "attention_dir", "check_causal"))}

Examples:
  python sample.py out_dir=runs/cpu start="ROMEO:" num_samples=2 max_new_tokens=200
  python sample.py out_dir=runs/cpu start="'To be, or not'" temperature=0   # quote text with commas twice
  python sample.py out_dir=runs/cpu start="ROMEO:" max_new_tokens=60 attention_dir=maps

Every key: docs/reference.md. Hydra's own flags: --hydra-help."""


if __name__ == "__main__":
    if any("${" in arg for arg in sys.argv[1:]):  # a prompt's ${...} is text, not an interpolation
        sys.argv[1:] = literal_text(sys.argv[1:], ("start", "stop"))
    run_hydra(main, "sample", SampleConfig, usage=usage)
