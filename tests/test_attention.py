"""masked_attention as the textbook states it: one formula, any mask."""

import math

import torch

from model import causal_mask, masked_attention


def test_weights_quarter_three_quarters_give_the_weighted_values() -> None:
    # Weights 0.25 / 0.75 over values [2, 0] and [0, 4] give [0.5, 3].
    q = torch.tensor([[1.0]])
    k = torch.tensor([[0.0], [math.log(3.0)]])
    v = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    out, weights = masked_attention(q, k, v, torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(weights, torch.tensor([[0.25, 0.75]]))
    torch.testing.assert_close(out, torch.tensor([[0.5, 3.0]]))


def test_scores_are_scaled_by_the_square_root_of_the_key_dimension() -> None:
    q = torch.ones(1, 4)
    k = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # scores 0 and 4 / sqrt(4) = 2
    _, weights = masked_attention(q, k, torch.eye(2), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[0.0, 2.0]]), dim=-1))


def test_masking_with_minus_infinity_equals_zeroing_and_renormalising() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 3)
    mask = torch.rand(6, 6) > 0.4
    mask[:, 0] = True  # every row keeps at least one key
    _, masked = masked_attention(q, k, v, mask)
    _, unmasked = masked_attention(q, k, v, torch.ones(6, 6, dtype=torch.bool))
    renormalised = unmasked * mask
    renormalised = renormalised / renormalised.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(masked, renormalised)
    assert torch.equal(masked[~mask], torch.zeros(int((~mask).sum())))


def test_cross_attention_of_three_queries_over_five_keys() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 7)
    out, weights = masked_attention(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    assert out.shape == (2, 3, 7) and weights.shape == (2, 3, 5)
    expected = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v
    torch.testing.assert_close(out, expected)


def test_the_causal_mask_aligns_to_the_last_keys_and_a_window_bands_it() -> None:
    """A KV-cache decode step's queries see the keys up to their own; a window of w lets query i see i - w + 1 to i."""
    torch.manual_seed(3)
    q, k, v = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4)
    full, _ = masked_attention(q, k, v, causal_mask(5, 5))
    last_two, _ = masked_attention(q[3:], k, v, causal_mask(2, 5))
    torch.testing.assert_close(last_two, full[3:])
    assert causal_mask(2, 5).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert causal_mask(4, 4, window=2).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert causal_mask(1, 7, window=3).tolist() == [[0, 0, 0, 0, 1, 1, 1]]  # query 6 of 7 sees keys 4 to 6
    assert torch.equal(causal_mask(6, 6, window=6), causal_mask(6, 6))
