"""Backend option validation: TorchTPU's keys, unknown keys, and mode=."""
import pytest
import torch

from tpu_dynamo.options import Options, parse

from conftest import backend_error


def test_known_options_parse():
    cb = lambda info: None  # noqa: E731
    assert parse({"debug_callback": cb, "name": "g", "async_compile": False}, None, None) == Options(cb, "g")
    assert parse(None, "default", "outer") == Options(None, "outer")


def test_unknown_key_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'bogus'"):
        parse({"bogus": 1}, None, None)


@pytest.mark.parametrize("key,value", [("serializable", True), ("async_compile", True)])
def test_unimplemented_options_are_rejected_when_not_default(key, value):
    with pytest.raises(NotImplementedError, match=key):
        parse({key: value}, None, None)


def test_bucket_options_are_validated_with_torchtpu_defaults():
    buckets = parse({"num_dynamic_buckets": 2, "bucket_size": 16}, None, None).buckets
    assert (buckets.size, buckets.count) == (16, 2)
    assert [buckets.pad(n) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 33]  # past the last: exact
    assert parse({"bucket_size": 64}, None, None).buckets.count == 8
    assert parse({"num_dynamic_buckets": 3}, None, None).buckets.size == 128
    assert parse(None, None, None).buckets is None
    with pytest.raises(ValueError, match="num_dynamic_buckets"):
        parse({"num_dynamic_buckets": 9}, None, None)


def test_precompute_weights_is_a_bool_on_by_default():
    assert parse(None, None, None).precompute_weights
    assert not parse({"precompute_weights": False}, None, None).precompute_weights
    with pytest.raises(TypeError, match="precompute_weights must be a bool"):
        parse({"precompute_weights": 1}, None, None)


def test_automatic_buckets_at_most_double_the_size():
    from tpu_dynamo.options import PowersOfTwo

    assert [PowersOfTwo.pad(n) for n in (1, 2, 3, 9, 16, 17, 1000)] == [1, 2, 4, 16, 16, 32, 1024]


def test_unknown_key_through_torch_compile():
    f = torch.compile(lambda x: x + 1, backend="tpu", options={"bogus": 1})
    with pytest.raises(Exception) as excinfo:
        f(torch.randn(2))
    assert isinstance(backend_error(excinfo), TypeError)
    assert "bogus" in str(excinfo.value)


def test_mode_is_rejected():
    # torch.compile passes mode= to a custom backend only when it is not "default".
    f = torch.compile(lambda x: x + 1, backend="tpu", mode="max-autotune")
    with pytest.raises(Exception) as excinfo:
        f(torch.randn(2))
    assert isinstance(backend_error(excinfo), ValueError)
    assert "mode='max-autotune'" in str(excinfo.value)


def test_training_is_rejected():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(Exception) as excinfo:
        torch.compile(m, backend="tpu")(torch.randn(4, 3))
    assert "training" in str(backend_error(excinfo))


def test_backend_names_come_from_entry_points():
    from torch._dynamo.backends.registry import lookup_backend

    from tpu_dynamo.backend import tpu_backend

    assert lookup_backend("tpu") is tpu_backend
    assert lookup_backend("tpu_dynamo") is tpu_backend
