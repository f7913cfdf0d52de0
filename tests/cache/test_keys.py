"""content_hash, CacheKey and CachePolicy: stability, sensitivity, validation."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarena.cache.keys import CacheKey, CachePolicy, content_hash

# ---------------------------------------------------------------------------------------
# Cross-process stability. The same builder runs here and in fresh interpreters with
# different PYTHONHASHSEEDs, so nothing may depend on hash() salting or addresses.
_BUILDER = textwrap.dedent(
    """
    import torch
    from kvarena.cache.keys import CacheKey, content_hash

    def build():
        g = torch.Generator().manual_seed(1234)
        base = torch.randn(6, 5, generator=g)
        objs = {
            "str": "h\\u00e9llo w\\u00f6rld",
            "bytes": bytes(range(7)),
            "bigint": 12345678901234567890123,
            "neg": -3,
            "float": 0.1,
            "complex": 1.5 - 2j,
            "none": None,
            "bool": True,
            "tuple": (1, "a", None, 2.5),
            "list": [1, [2, [3, "x"]]],
            "dict": {"b": 2, "a": [1.5, None], 3: (True,)},
            "f32": base,
            "bf16": base.to(torch.bfloat16),
            "f16_transposed": base.half().t(),
            "i64": torch.arange(10),
            "bool_tensor": base > 0,
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "nested": {"x": (base, base.to(torch.bfloat16)), "y": [torch.zeros(2, dtype=torch.int8)]},
            "dtype": torch.bfloat16,
        }
        out = {name: content_hash(obj) for name, obj in objs.items()}
        out["key"] = CacheKey(
            "text_encoder", out["str"], "w7", (("lora", "v2"),), dtype="bfloat16",
            quantization="fp8", tokenizer="tok-1", template="chat", max_length=512,
        ).hash
        out["key_default"] = CacheKey("vae", "abc", "w0").hash
        return out
    """
)


def _build_here() -> dict[str, str]:
    namespace: dict = {}
    exec(_BUILDER, namespace)
    return namespace["build"]()


def test_content_hash_and_key_hash_equal_across_processes() -> None:
    script = _BUILDER + "\nimport json\nprint(json.dumps(build()))\n"
    procs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    here = _build_here()
    assert results[0] == here
    assert results[1] == here
    # the digests are not degenerate: every object hashes differently
    assert len(set(here.values())) == len(here)
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in here.values())


# ---------------------------------------------------------------------------------------
# Sensitivity: any change of content, dtype or shape changes the digest.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.float64]


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_changing_one_element_changes_hash(dtype: torch.dtype, seed: int) -> None:
    t = (torch.rand(4, 7) * 100).to(dtype)
    idx = random.Random(seed).randrange(t.numel())
    changed = t.clone()
    changed.view(-1)[idx] += 1
    assert not torch.equal(t, changed)
    assert content_hash(changed) != content_hash(t)
    assert content_hash(t.clone()) == content_hash(t)


@pytest.mark.parametrize(
    "a, b",
    [
        pytest.param(torch.float32, torch.float64, id="f32-vs-f64-same-values"),
        pytest.param(torch.float16, torch.bfloat16, id="f16-vs-bf16-same-values"),
        pytest.param(torch.int32, torch.int64, id="i32-vs-i64"),
    ],
)
def test_changing_dtype_changes_hash(a: torch.dtype, b: torch.dtype) -> None:
    t = torch.arange(12).reshape(3, 4)
    assert content_hash(t.to(a)) != content_hash(t.to(b))


@pytest.mark.parametrize(
    "a, b",
    [
        pytest.param(torch.float32, torch.int32, id="f32-vs-i32-same-bits"),
        pytest.param(torch.float16, torch.bfloat16, id="f16-vs-bf16-same-bits"),
    ],
)
def test_same_bytes_other_dtype_changes_hash(a: torch.dtype, b: torch.dtype, seed: int) -> None:
    t = torch.randn(5, 3).to(a)
    same_bits = t.view(b)
    assert t.view(torch.uint8).tolist() == same_bits.view(torch.uint8).tolist()
    assert content_hash(t) != content_hash(same_bits)


@pytest.mark.parametrize("shape", [(12,), (4, 3), (2, 2, 3), (1, 12)], ids=str)
def test_changing_shape_changes_hash(shape: tuple[int, ...], seed: int) -> None:
    t = torch.randn(3, 4)
    assert content_hash(t.reshape(shape)) != content_hash(t)


def test_zero_dim_vs_one_element_differ() -> None:
    assert content_hash(torch.tensor(1.0)) != content_hash(torch.tensor([1.0]))


# ---------------------------------------------------------------------------------------
# Equal content, any memory layout.
def _views(base: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    big = torch.zeros(base.shape[0] + 2, base.shape[1] * 2, dtype=base.dtype)
    big[1 : 1 + base.shape[0], ::2] = base
    return [
        ("transposed-twice", base.t().contiguous().t()),
        ("strided-slice-with-offset", big[1 : 1 + base.shape[0], ::2]),
        ("requires-grad", base.detach().clone().requires_grad_(base.is_floating_point())),
        ("column-major-copy", base.t().clone().t()),
    ]


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_noncontiguous_views_hash_like_contiguous(dtype: torch.dtype, seed: int) -> None:
    base = (torch.rand(5, 6) * 50).to(dtype)
    expected = content_hash(base)
    for name, view in _views(base):
        assert torch.equal(view, base), name
        assert content_hash(view) == expected, name
    assert not base.t().contiguous().t().is_contiguous()


def test_expanded_and_channels_last_hash_like_materialized(seed: int) -> None:
    row = torch.randn(1, 8)
    expanded = row.expand(4, 8)
    assert expanded.stride(0) == 0
    assert content_hash(expanded) == content_hash(expanded.contiguous())
    img = torch.randn(2, 3, 4, 5)
    cl = img.to(memory_format=torch.channels_last)
    assert not cl.is_contiguous()
    assert content_hash(cl) == content_hash(img)


def test_conj_and_neg_views_hash_like_materialized(seed: int) -> None:
    z = torch.randn(3, 4, dtype=torch.complex64)
    assert z.conj().is_conj()
    assert content_hash(z.conj()) == content_hash(z.conj().resolve_conj())
    assert content_hash(z.conj()) != content_hash(z)


def test_sparse_hashes_like_dense(seed: int) -> None:
    dense = torch.zeros(4, 5)
    dense[1, 2] = 3.0
    dense[3, 0] = -1.0
    assert content_hash(dense.to_sparse()) == content_hash(dense)


def test_bf16_tensor_hash_matches_its_bits(seed: int) -> None:
    t = torch.randn(3, 5).to(torch.bfloat16)
    same = t.view(torch.int16).clone().view(torch.bfloat16)
    assert content_hash(same) == content_hash(t)
    bumped = t.view(torch.int16).clone()
    bumped[0, 0] ^= 1
    assert content_hash(bumped.view(torch.bfloat16)) != content_hash(t)


# ---------------------------------------------------------------------------------------
# Python values.
@pytest.mark.parametrize(
    "a, b",
    [
        pytest.param(True, 1, id="bool-vs-int"),
        pytest.param(1, 1.0, id="int-vs-float"),
        pytest.param(True, 1.0, id="bool-vs-float"),
        pytest.param(1.0, 1 + 0j, id="float-vs-complex"),
        pytest.param((1, 2), [1, 2], id="tuple-vs-list"),
        pytest.param("1", 1, id="str-vs-int"),
        pytest.param("a", b"a", id="str-vs-bytes"),
        pytest.param(None, "None", id="none-vs-str"),
        pytest.param(["ab", "c"], ["a", "bc"], id="str-boundaries"),
        pytest.param(((1, 2), 3), (1, (2, 3)), id="nesting"),
        pytest.param({"a": 1}, {"a": 2}, id="dict-value"),
        pytest.param({"a": 1}, {"b": 1}, id="dict-key"),
        pytest.param({"a": 1, "b": 2}, [("a", 1), ("b", 2)], id="dict-vs-pairs"),
        pytest.param(0.0, -0.0, id="zero-signs"),
        pytest.param(2**64, 2**64 + 1, id="bigint"),
        pytest.param(torch.float16, torch.bfloat16, id="dtypes"),
    ],
)
def test_distinct_values_hash_differently(a: object, b: object) -> None:
    assert content_hash(a) != content_hash(b)


def test_nan_is_one_value() -> None:
    assert content_hash(float("nan")) == content_hash(-float("nan"))


def test_dict_hash_is_order_independent(seed: int) -> None:
    rng = random.Random(seed)
    items = [(f"k{i}", [i, str(i), torch.full((2,), float(i))]) for i in range(12)]
    shuffled = items[:]
    rng.shuffle(shuffled)
    assert [k for k, _ in shuffled] != [k for k, _ in items]
    assert content_hash(dict(items)) == content_hash(dict(shuffled))


def test_bytes_like_types_hash_by_content() -> None:
    assert content_hash(bytearray(b"abc")) == content_hash(b"abc")
    assert content_hash(memoryview(b"abc")) == content_hash(b"abc")


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=_values, rnd=st.randoms(use_true_random=False))
def test_hash_is_a_function_of_content(value: object, rnd: random.Random) -> None:
    def rebuild(v: object) -> object:
        # an equal value made of fresh objects, dicts in another insertion order
        if isinstance(v, list):
            return [rebuild(x) for x in v]
        if isinstance(v, tuple):
            return tuple(rebuild(x) for x in v)
        if isinstance(v, dict):
            items = list(v.items())
            rnd.shuffle(items)
            return {k: rebuild(x) for k, x in items}
        if isinstance(v, bytes):
            return bytes(bytearray(v))
        return v

    assert content_hash(rebuild(value)) == content_hash(value)
    assert content_hash([value]) != content_hash((value,))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(object(), id="object"),
        pytest.param({1, 2}, id="set"),
        pytest.param(lambda: 0, id="lambda"),
        pytest.param([1, object()], id="object-in-list"),
        pytest.param({"a": {"b": object()}}, id="object-in-dict"),
        pytest.param({object(): 1}, id="object-dict-key"),
        pytest.param(torch.empty(3, device="meta"), id="meta-tensor"),
    ],
)
def test_unhashable_content_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="content_hash"):
        content_hash(bad)


def test_cyclic_container_raises_value_error() -> None:
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="cyclic"):
        content_hash(loop)


def test_repeated_non_cyclic_container_is_fine() -> None:
    shared = [1, 2]
    assert content_hash([shared, shared]) == content_hash([[1, 2], [1, 2]])


# ---------------------------------------------------------------------------------------
# CacheKey
def _key(**overrides: object) -> CacheKey:
    fields = dict(
        component_id="text_encoder",
        content_hash="c0ffee",
        weights_version="w1",
        adapter_versions=(("lora_a", "v1"),),
        dtype="bfloat16",
        quantization="fp8",
        tokenizer="tok",
        template="chat-v1",
        max_length=256,
    )
    fields.update(overrides)
    return CacheKey(**fields)


def test_equal_keys_have_equal_hash() -> None:
    a, b = _key(), _key()
    assert a == b and a.hash == b.hash and hash(a) == hash(b)
    assert len({a, b}) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("component_id", "vision_encoder"),
        ("content_hash", "c0ffef"),
        ("weights_version", "w2"),
        ("adapter_versions", (("lora_a", "v2"),)),
        ("adapter_versions", ()),
        ("dtype", "float16"),
        ("dtype", None),
        ("quantization", None),
        ("tokenizer", "tok2"),
        ("template", "chat-v2"),
        ("max_length", 512),
        ("max_length", None),
    ],
)
def test_each_field_changes_the_hash(field: str, value: object) -> None:
    base = _key()
    other = dataclasses.replace(base, **{field: value})
    assert other != base
    assert other.hash != base.hash


def test_adapter_order_matters() -> None:
    a = _key(adapter_versions=("x", "y"))
    b = _key(adapter_versions=("y", "x"))
    assert a.hash != b.hash


def test_key_normalizes_lists_and_dtypes() -> None:
    a = _key(adapter_versions=[["lora_a", "v1"]], dtype=torch.bfloat16)
    b = _key(adapter_versions=(("lora_a", "v1"),), dtype="torch.bfloat16")
    assert a.adapter_versions == (("lora_a", "v1"),)
    assert a.dtype == b.dtype == "bfloat16"
    assert a == b and a.hash == b.hash
    hash(a)  # hashable even when built from lists


def test_key_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _key().weights_version = "w9"  # type: ignore[misc]


def test_from_content_uses_content_hash(seed: int) -> None:
    tokens = torch.randint(0, 1000, (17,))
    key = CacheKey.from_content("te", tokens, "w1", max_length=17)
    assert key == CacheKey("te", content_hash(tokens), "w1", max_length=17)


@pytest.mark.parametrize(
    "overrides, exc, name",
    [
        ({"component_id": 3}, TypeError, "component_id"),
        ({"component_id": ""}, ValueError, "component_id"),
        ({"content_hash": None}, TypeError, "content_hash"),
        ({"content_hash": ""}, ValueError, "content_hash"),
        ({"weights_version": 1}, TypeError, "weights_version"),
        ({"adapter_versions": "lora"}, TypeError, "adapter_versions"),
        ({"adapter_versions": {"lora": 1}}, TypeError, "adapter_versions"),
        ({"adapter_versions": (object(),)}, TypeError, "adapter_versions"),
        ({"dtype": 3}, TypeError, "dtype"),
        ({"quantization": 8}, TypeError, "quantization"),
        ({"tokenizer": b"tok"}, TypeError, "tokenizer"),
        ({"template": 1.0}, TypeError, "template"),
        ({"max_length": -1}, ValueError, "max_length"),
        ({"max_length": True}, TypeError, "max_length"),
        ({"max_length": 2.0}, TypeError, "max_length"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_key_validation_names_the_field(overrides: dict, exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        _key(**overrides)


# ---------------------------------------------------------------------------------------
# CachePolicy
def test_policy_defaults_and_per_component_mapping() -> None:
    source = {"window": 6, "sinks": 1}
    p = CachePolicy("slab_kv", 1 << 20, per_component=source)
    assert p.block_bytes == 0 and p.reuse_across_requests and not p.training_mode_disables_recycle
    assert p.per_component.get("window") == 6
    assert p.per_component.get("slab_tokens") is None
    assert list(p.per_component) == ["sinks", "window"]  # sorted, deterministic
    source["window"] = 99  # the policy holds its own copy
    assert p.per_component["window"] == 6
    with pytest.raises(TypeError):
        p.per_component["window"] = 1  # type: ignore[index]
    assert CachePolicy("feature", 10).per_component.get("window") is None


def test_policy_is_frozen_hashable_comparable_and_picklable() -> None:
    a = CachePolicy("slab_kv", 100, per_component={"window": 3, "sinks": 1})
    b = CachePolicy("slab_kv", 100, per_component={"sinks": 1, "window": 3})
    assert a == b and hash(a) == hash(b)
    assert a != CachePolicy("slab_kv", 100, per_component={"window": 4, "sinks": 1})
    assert pickle.loads(pickle.dumps(a)) == a
    assert dataclasses.replace(a, max_bytes=5).per_component == a.per_component
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"max_bytes": -1}, ValueError, "max_bytes"),
        ({"max_bytes": True}, TypeError, "max_bytes"),
        ({"max_bytes": 1.5}, TypeError, "max_bytes"),
        ({"max_bytes": "10"}, TypeError, "max_bytes"),
        ({"max_bytes": None}, TypeError, "max_bytes"),
        ({"block_bytes": -4}, ValueError, "block_bytes"),
        ({"block_bytes": False}, TypeError, "block_bytes"),
        ({"class_name": 3}, TypeError, "class_name"),
        ({"class_name": ""}, ValueError, "class_name"),
        ({"reuse_across_requests": 1}, TypeError, "reuse_across_requests"),
        ({"training_mode_disables_recycle": "yes"}, TypeError, "training_mode_disables_recycle"),
        ({"per_component": [("window", 3)]}, TypeError, "per_component"),
        ({"per_component": {"window": 1.5}}, TypeError, "per_component.*window"),
        ({"per_component": {"window": True}}, TypeError, "per_component.*window"),
        ({"per_component": {"sinks": -1}}, ValueError, "per_component.*sinks"),
        ({"per_component": {3: 1}}, TypeError, "per_component"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_policy_validation_names_the_argument(kwargs: dict, exc: type, name: str) -> None:
    args = {"class_name": "feature", "max_bytes": 1024}
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        CachePolicy(**args)


def test_policy_accepts_zero_budgets() -> None:
    p = CachePolicy("residual", 0, block_bytes=0, per_component={"window": 0})
    assert p.max_bytes == 0 and p.per_component["window"] == 0
