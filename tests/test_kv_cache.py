import pytest
import torch

from model import GPT, GPTConfig
from model.attention import KVCache

CONFIG = dict(vocab_size=40, block_size=24, n_layer=2, n_head=4, n_embd=32)


def _model(attn_impl: str, pos_emb: str = "learned") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG, attn_impl=attn_impl, pos_emb=pos_emb)).eval()


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize("prompt_length", [1, 7])
def test_cached_logits_match_recomputation(attn_impl: str, prompt_length: int, pos_emb: str) -> None:
    model = _model(attn_impl, pos_emb)
    idx = torch.randint(CONFIG["vocab_size"], (2, CONFIG["block_size"]))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config)
        prefill, _ = model(idx[:, :prompt_length], cache=cache)
        torch.testing.assert_close(prefill, full[:, :prompt_length], atol=1e-5, rtol=0)
        for t in range(prompt_length, CONFIG["block_size"]):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0)
    assert cache.length == CONFIG["block_size"]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize("prompt_length", [1, 5])
def test_greedy_tokens_are_identical_with_and_without_the_cache(
    attn_impl: str, prompt_length: int, pos_emb: str
) -> None:
    model = _model(attn_impl, pos_emb)
    prompt = torch.randint(CONFIG["vocab_size"], (1, prompt_length))
    new = 2 * CONFIG["block_size"]  # crosses block_size: the cache gives way to recomputing the window
    cached = model.generate(prompt, new, top_k=1, use_cache=True)
    recomputed = model.generate(prompt, new, top_k=1, use_cache=False)
    assert cached.shape == (1, prompt_length + new)
    assert torch.equal(cached, recomputed)


def test_a_prompt_longer_than_block_size_is_cropped_either_way() -> None:
    model = _model("flash")
    prompt = torch.randint(CONFIG["vocab_size"], (1, CONFIG["block_size"] + 5))
    assert torch.equal(model.generate(prompt, 6, top_k=1), model.generate(prompt, 6, top_k=1, use_cache=False))


def test_sampling_with_the_cache_is_seeded() -> None:
    model = _model("math")
    prompt = torch.zeros(1, 1, dtype=torch.long)
    torch.manual_seed(4)
    first = model.generate(prompt, 30, temperature=0.9, top_k=10)
    torch.manual_seed(4)
    assert torch.equal(first, model.generate(prompt, 30, temperature=0.9, top_k=10))


def test_the_cache_refuses_to_grow_past_block_size() -> None:
    model = _model("math")
    cache = KVCache(model.config)
    with torch.no_grad():
        model(torch.zeros(1, CONFIG["block_size"], dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="block_size"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
