"""Input pipelines: batch i depends only on (seed, i); text windows; clear errors."""

import sys

import numpy as np
import pytest

from hybrid.run import data

import runner


def take(dataset, count):
    return [(x.numpy(), y.numpy()) for x, y in dataset.take(count)]


@pytest.mark.parametrize(
    "spec,model,kwargs",
    [
        ("text:python-docs", "transformer", {"seq_len": 16}),
        ("synthetic", "transformer", {"seq_len": 16}),
        ("synthetic", "mlp", {"input_shape": (12,)}),
        ("synthetic", "resnet", {"input_shape": (6, 6, 3)}),
    ],
)
def test_a_resumed_dataset_continues_with_the_same_batches(spec, model, kwargs):
    whole = take(data.dataset(spec, model, 8, seed=3, **kwargs), 5)
    resumed = take(data.dataset(spec, model, 8, seed=3, start_step=2, **kwargs), 3)
    for (x, y), (rx, ry) in zip(whole[2:], resumed, strict=True):
        np.testing.assert_array_equal(rx, x)
        np.testing.assert_array_equal(ry, y)
    other_seed = take(data.dataset(spec, model, 8, seed=4, **kwargs), 1)
    assert not np.array_equal(other_seed[0][0], whole[0][0])
    assert not np.array_equal(whole[1][0], whole[0][0])  # every step draws a new batch


def test_text_windows_predict_the_next_byte(tmp_path):
    path = tmp_path / "corpus.txt"
    text = b"the quick brown fox jumps over the lazy dog. " * 20
    path.write_bytes(text)
    ((x, y),) = take(data.dataset(f"text:{path}", "transformer", 4, seq_len=10), 1)
    assert x.shape == y.shape == (4, 10) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y, strict=True):  # each window is a real slice of the text
        window = bytes(row_x.tolist()) + bytes([row_y[-1]])
        assert window in text


def test_the_builtin_text_is_the_python_manual():
    corpus = data.load_text(data.BUILTIN_TEXT)
    assert corpus.size > 100_000
    assert b"assert" in corpus.tobytes()[:10_000]


def test_synthetic_labels_are_a_function_of_the_inputs():
    ((x, y),) = take(data.dataset("synthetic", "mlp", 256, input_shape=(12,)), 1)
    assert x.shape == (256, 12) and y.shape == (256,)
    assert len(np.unique(y)) > 3  # a real classification task, not one class


@pytest.mark.parametrize(
    "spec,model,message",
    [
        ("imagenet", "mlp", "unknown data source 'imagenet'; use 'synthetic', 'text:PATH'"),
        ("text:", "transformer", "unknown data source 'text:'"),
        ("text:/no/such.txt", "transformer", "data file '/no/such.txt'"),
        ("text:python-docs", "mlp", "is a language-modelling corpus, but model 'mlp'"),
    ],
)
def test_bad_sources_say_what_to_use(spec, model, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        data.dataset(spec, model, 8)


def test_a_text_shorter_than_a_window_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"tiny")
    with pytest.raises(ValueError, match="the text has 4 bytes, fewer than seq_len"):
        data.dataset(f"text:{path}", "transformer", 2, seq_len=8)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
