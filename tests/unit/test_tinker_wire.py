"""The Tinker wire format (``service.tinker.wire``) against the tinker SDK itself: requests the SDK
builds and serializes (raw and zstd-compressed) decode field for field; results we encode decode with
the SDK's own readers; every kind of hostile body is a ``WireError`` that names the problem, and
random bytes or mutations of a valid body never raise anything else."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
import zstandard
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from service.tinker import proto_schema, wire
from service.tinker.wire import (
    ForwardBackwardCall,
    SampledSequence,
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from tests.helpers.data import ROOT

MAX_BYTES = 1 << 20
MAX_TOKENS = 10_000


def _request(
    data: list[types.Datum],
    *,
    loss_fn: types.LossFnType = "cross_entropy",
    config: dict[str, float | str] | None = None,
    model_id: str = "model-1",
    seq_id: int = 7,
) -> Any:
    """The SDK's own ForwardBackwardRequest proto for ``data``."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request)


def _datum(tokens: list[int], **inputs: Any) -> types.Datum:
    if not inputs:
        targets = tokens[1:] + [0]
        inputs = {"target_tokens": targets, "weights": [1.0] * len(tokens)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _decode(body: bytes, encoding: str | None = None, **limits: int) -> ForwardBackwardCall:
    return decode_forward_backward(
        body,
        content_encoding=encoding,
        max_bytes=limits.get("max_bytes", MAX_BYTES),
        max_tokens=limits.get("max_tokens", MAX_TOKENS),
    )


def _refused(body: bytes, *fragments: str, encoding: str | None = None, **limits: int) -> WireError:
    with pytest.raises(WireError) as caught:
        _decode(body, encoding, **limits)
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    return caught.value


# The messages --------------------------------------------------------------------------------------
def _sdk_file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(proto)
    return proto


def test_every_message_we_build_is_the_sdks_field_for_field() -> None:
    ours, theirs = proto_schema.FILE_DESCRIPTOR, _sdk_file()
    assert (ours.name, ours.package, ours.syntax) == (theirs.name, theirs.package, theirs.syntax)
    sdk_messages = {message.name: message for message in theirs.message_type}
    assert len(ours.message_type) >= 20
    for message in ours.message_type:
        assert message == sdk_messages[message.name], message.name  # fields, oneofs, nested map entries, options
    sdk_enums = {enum.name: enum for enum in theirs.enum_type}
    assert [enum.name for enum in ours.enum_type] == ["StopReason", "DType"]
    for enum in ours.enum_type:
        assert enum == sdk_enums[enum.name]
    # Only what the server needs: the sampling request's parameters travel as JSON.
    assert {"SamplingParams", "StopStrings", "StopTokens"}.isdisjoint(m.name for m in ours.message_type)


def test_our_classes_live_in_a_pool_of_their_own() -> None:
    tensor = wire.message_class("Tensor")
    assert tensor.DESCRIPTOR.full_name == "tinker_public.Tensor"
    assert tensor.DESCRIPTOR.file.pool is not sdk_pb.DESCRIPTOR.pool
    assert tensor is not sdk_pb.Tensor
    # Bytes cross between the two freely.
    theirs = sdk_pb.Tensor(dense=b"\x01\x00\x00\x00", dtype=sdk_pb.DTYPE_FLOAT32, shape=[1])
    assert tensor.FromString(theirs.SerializeToString()).shape == [1]


def test_the_server_module_never_imports_the_sdk() -> None:
    code = "import sys, service.tinker.wire; print(sorted(m for m in sys.modules if m.split('.')[0] == 'tinker'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Requests the SDK sends ----------------------------------------------------------------------------
def test_a_forward_backward_request_decodes_field_for_field() -> None:
    data = [
        _datum([5, 6, 7, 8]),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3, 2_000_000_000])]
            ),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[2, 3, 9, 0], dtype="int64", shape=[4]),
                "weights": types.TensorData(data=[0.0, 0.5, 1.0, 1.0], dtype="float32", shape=[4]),
                "advantages": types.TensorData.from_numpy(np.array([0.25, -1.5, 3.0, 0.0])),  # float64: sent as float32
                "logprobs": types.TensorData(data=[-1.0, -2.0, -3.0, -4.0], dtype="float32"),  # no shape: 1-D
            },
        ),
    ]
    message = _request(data, loss_fn="importance_sampling", config={"clip_low": 0.8, "kl": 0.0}, seq_id=41)
    message.forward_only = True
    call = _decode(message.SerializeToString())
    assert call.model_id == "model-1" and call.seq_id == 41 and call.loss_fn == "importance_sampling"
    assert call.forward_only is True
    assert call.loss_fn_config == {"clip_low": 0.8, "kl": 0.0}
    assert len(call.data) == 2
    first, second = call.data
    assert first.tokens.dtype == np.int64 and first.tokens.tolist() == [5, 6, 7, 8]
    assert second.tokens.dtype == np.int64 and second.tokens.tolist() == [1, 2, 3, 2_000_000_000]
    assert sorted(first.loss_fn_inputs) == ["target_tokens", "weights"]
    assert first.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert first.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 0]
    assert first.loss_fn_inputs["weights"].dtype == np.float32
    assert first.loss_fn_inputs["weights"].tolist() == [1.0] * 4
    for name, expected in data[1].loss_fn_inputs.items():
        got = second.loss_fn_inputs[name]
        assert got.dtype == expected.to_numpy().dtype, name
        assert got.shape == (4,), name
        np.testing.assert_array_equal(got, expected.to_numpy())


def test_two_dimensional_inputs_keep_their_shape() -> None:
    targets = np.arange(12, dtype=np.int64).reshape(4, 3)
    weights = np.linspace(0, 1, 12, dtype=np.float32).reshape(4, 3)
    call = _decode(_request([_datum([1, 2, 3, 4], target_tokens=targets, weights=weights)]).SerializeToString())
    got = call.data[0].loss_fn_inputs
    assert got["target_tokens"].shape == (4, 3) and got["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(got["target_tokens"], targets)
    assert got["weights"].shape == (4, 3) and got["weights"].dtype == np.float32
    np.testing.assert_array_equal(got["weights"], weights)


def test_a_sparse_csr_input_arrives_dense_as_the_sdk_densifies_it() -> None:
    dense = np.array([[0, 7, 0, 0], [0, 0, 0, 0], [3, 0, 0, 9]], dtype=np.int64)
    sparse = types.TensorData(
        data=[7, 3, 9], dtype="int64", shape=[3, 4], sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 3]
    )
    weights = types.TensorData(
        data=[0.5], dtype="float32", shape=[3, 4], sparse_crow_indices=[0, 0, 1, 1], sparse_col_indices=[2]
    )
    call = _decode(_request([_datum([1, 2, 3], target_tokens=sparse, weights=weights)]).SerializeToString())
    got = call.data[0].loss_fn_inputs
    assert got["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(got["target_tokens"], dense)
    np.testing.assert_array_equal(got["target_tokens"], sparse.to_numpy())
    assert got["weights"].dtype == np.float32
    np.testing.assert_array_equal(got["weights"], weights.to_numpy())


@pytest.mark.parametrize("how", ["sdk", "streamed", "two frames"])
def test_a_zstd_body_decodes_as_the_raw_one(how: str) -> None:
    body = _request([_datum(list(range(1, 200))), _datum([9, 8, 7])], config={"beta": 0.1}).SerializeToString()
    if how == "sdk":  # what resources/training.py sends: one frame that declares its size
        compressed = zstandard.ZstdCompressor().compress(body)
        assert zstandard.get_frame_parameters(compressed).content_size == len(body)
    elif how == "streamed":  # a frame that does not declare its size
        stream = zstandard.ZstdCompressor(level=19).compressobj()
        compressed = stream.compress(body) + stream.flush()
        assert zstandard.get_frame_parameters(compressed).content_size == zstandard.CONTENTSIZE_UNKNOWN
    else:
        half = len(body) // 2
        compressed = zstandard.ZstdCompressor().compress(body[:half]) + zstandard.ZstdCompressor().compress(body[half:])
    for encoding in ("zstd", "ZSTD", " zstd "):
        call = _decode(compressed, encoding)
        assert _same_call(call, _decode(body))
    assert _same_call(_decode(body, "identity"), _decode(body))


def _same_call(a: ForwardBackwardCall, b: ForwardBackwardCall) -> bool:
    head = (a.model_id, a.seq_id, a.loss_fn, a.loss_fn_config, a.forward_only, len(a.data))
    if head != (b.model_id, b.seq_id, b.loss_fn, b.loss_fn_config, b.forward_only, len(b.data)):
        return False
    for x, y in zip(a.data, b.data, strict=True):
        if not np.array_equal(x.tokens, y.tokens) or sorted(x.loss_fn_inputs) != sorted(y.loss_fn_inputs):
            return False
        if not all(np.array_equal(x.loss_fn_inputs[k], y.loss_fn_inputs[k]) for k in x.loss_fn_inputs):
            return False
    return True


def test_the_v2_config_wins_and_carries_strings_the_legacy_map_alone_is_read_too() -> None:
    message = _request([_datum([1, 2])], config={"clip": 0.2, "mode": "token", "n": 3})
    assert dict(message.loss_fn_config) == {"clip": 0.2, "n": 3.0}  # the SDK writes both maps
    assert _decode(message.SerializeToString()).loss_fn_config == {"clip": 0.2, "mode": "token", "n": 3.0}
    message.ClearField("loss_fn_config_v2")  # an older SDK: the float map alone
    config = _decode(message.SerializeToString()).loss_fn_config
    assert config == {"clip": 0.2, "n": 3.0} and all(isinstance(v, float) for v in config.values())
    message.ClearField("loss_fn_config")
    assert _decode(message.SerializeToString()).loss_fn_config == {}


def test_provenance_spans_are_read_past() -> None:
    datum = _datum([1, 2, 3]).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="s1", offset=0, length=2),
            types.SampledProvenanceSpan(sequence_id="s2", offset=0, length=1),
        ],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s2", offset=0, length=3)],
    )
    message = _request([datum])
    assert len(message.data[0].model_input_spans) == 2
    call = _decode(message.SerializeToString())
    assert call.data[0].tokens.tolist() == [1, 2, 3]


def test_fields_a_newer_sdk_adds_are_ignored() -> None:
    body = _request([_datum([4, 5])]).SerializeToString() + b"\xa8\x06\x01"  # field 101, varint 1
    assert _decode(body).data[0].tokens.tolist() == [4, 5]


# Hostile bodies ------------------------------------------------------------------------------------
def _valid_body() -> bytes:
    return _request([_datum([1, 2, 3, 4]), _datum([5, 6])], config={"a": 1.0}).SerializeToString()


def test_an_unknown_content_encoding_is_refused() -> None:
    error = _refused(_valid_body(), "Content-Encoding 'gzip' is not served here", "zstd", encoding="gzip")
    assert error.code == "unsupported_encoding"
    _refused(_valid_body(), "'zstd, gzip'", encoding="zstd, gzip")


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", b"\x1a\x05\x0a\x03", b"\x0a\x02\xc3\x28"])
def test_a_body_that_is_not_the_message_is_refused(body: bytes) -> None:
    _refused(body, "not a tinker_public.ForwardBackwardRequest", "application/x-protobuf")


def test_an_empty_body_or_one_without_data_is_refused() -> None:
    _refused(b"", "no data")
    _refused(_request([]).SerializeToString(), "no data: send at least one datum")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"this is not zstd at all", "not valid zstd"),
        (zstandard.ZstdCompressor().compress(b"\x0a\x01m") + b"junk!", "not valid zstd"),
        (zstandard.ZstdCompressor().compress(b"x" * 5000)[:-6], "cut short"),
        (zstandard.ZstdCompressor().compress(b"x" * 5000)[:9], "cut short"),
        (zstandard.ZstdCompressor().compress(b"") * 17, "more than 16 frames"),
    ],
)
def test_bad_zstd_is_refused(body: bytes, fragment: str) -> None:
    _refused(body, fragment, encoding="zstd")


def test_a_zstd_frame_asking_for_a_window_over_8_mib_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(19, window_log=24)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = stream.compress(_valid_body()) + stream.flush()
    _refused(body, "not valid zstd", "8 MiB", encoding="zstd")


def test_a_body_over_the_limit_is_refused() -> None:
    body = _valid_body()
    error = _refused(body, f"{len(body)} bytes, more than the limit of {len(body) - 1}", max_bytes=len(body) - 1)
    assert error.code == "too_large"
    assert _decode(body, max_bytes=len(body)).data  # exactly the limit is fine
    compressed = zstandard.ZstdCompressor().compress(body)
    _refused(compressed, f"more than {len(body) - 1} bytes", encoding="zstd", max_bytes=len(body) - 1)
    assert _decode(compressed, "zstd", max_bytes=len(body)).data


def _bomb(size: int, *, declared: bool) -> bytes:
    if declared:
        return zstandard.ZstdCompressor(level=1).compress(bytes(size))
    stream, chunk = zstandard.ZstdCompressor(level=1).compressobj(), bytes(1 << 20)
    parts = [stream.compress(chunk) for _ in range(size >> 20)]
    return b"".join([*parts, stream.flush()])


@pytest.mark.parametrize("declared", [True, False])
def test_a_zstd_bomb_is_stopped_at_the_cap(declared: bool) -> None:
    bomb = _bomb(256 << 20, declared=declared)  # 256 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    started = time.monotonic()
    try:
        error = _refused(bomb, "decompresses to more than 1048576 bytes", encoding="zstd")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.code == "too_large"
    assert peak < 2 * MAX_BYTES, peak  # one read of at most the cap + 1 bytes held at a time, none kept
    assert time.monotonic() - started < 5


def test_a_request_over_the_token_limit_names_its_total_and_the_limit() -> None:
    body = _request([_datum(list(range(1, 61))), _datum(list(range(1, 51)))]).SerializeToString()
    error = _refused(body, "holds 110 tokens over 2 datums", "the limit of 100", max_tokens=100)
    assert error.code == "too_large"
    assert len(_decode(body, max_tokens=110).data) == 2


def test_image_and_audio_chunks_are_refused() -> None:
    image = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=b"\x89PNG", format="png")]
        ),
        loss_fn_inputs={"weights": types.TensorData(data=[1.0], dtype="float32")},
    )
    error = _refused(
        _request([_datum([1]), image]).SerializeToString(),
        "data[1].model_input[1] is an image chunk",
        "images and audio are not served here: send encoded_text chunks",
    )
    assert error.param == "data[1].model_input[1]"
    message = _request([_datum([1])])
    message.data[0].model_input.add().dmel.dmel = b"\x00\x01"
    _refused(message.SerializeToString(), "data[0].model_input[1] is a dmel (audio) chunk", "images and audio")
    message = _request([_datum([1])])
    message.data[0].model_input.add()  # a chunk of no kind (a kind newer than this server)
    _refused(message.SerializeToString(), "data[0].model_input[1] is a chunk of no kind this server knows")


def test_a_datum_without_tokens_is_refused() -> None:
    message = _request([_datum([1, 2]), types.Datum(model_input=types.ModelInput(chunks=[]), loss_fn_inputs={})])
    _refused(message.SerializeToString(), "data[1] has no tokens")
    message = _request([types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs={})])
    _refused(message.SerializeToString(), "data[0] has no tokens")


def test_tokens_that_are_not_whole_int32s_or_are_negative_are_refused() -> None:
    message = _request([_datum([1, 2])])
    message.data[0].model_input[0].encoded_text.tokens += b"\x01"
    _refused(message.SerializeToString(), "data[0].model_input[0].encoded_text.tokens is 9 bytes", "int32")
    message = _request([_datum([1, 2]), _datum([3, -4, 5])])
    _refused(message.SerializeToString(), "data[1].model_input holds the token id -4 at position 1")


def _tensor_request(**fields: Any) -> Any:
    message = _request([_datum([1, 2, 3])])
    message.data[0].loss_fn_inputs["weights"].CopyFrom(sdk_pb.Tensor(**fields))
    return message.SerializeToString()


def test_a_tensor_whose_bytes_are_not_whole_elements_is_refused() -> None:
    body = _tensor_request(dense=b"\x00" * 10, dtype=sdk_pb.DTYPE_FLOAT32, shape=[3])
    error = _refused(body, "data[0].loss_fn_inputs['weights'] is 10 bytes", "float32 elements (4 bytes each)")
    assert error.param == "data[0].loss_fn_inputs['weights']"
    body = _tensor_request(dense=b"\x00" * 12, dtype=sdk_pb.DTYPE_INT64, shape=[3])
    _refused(body, "data[0].loss_fn_inputs['weights'] is 12 bytes", "int64 elements (8 bytes each)")


def test_a_tensor_whose_shape_disagrees_with_its_elements_is_refused() -> None:
    body = _tensor_request(dense=np.ones(3, np.float32).tobytes(), dtype=sdk_pb.DTYPE_FLOAT32, shape=[2, 2])
    _refused(body, "data[0].loss_fn_inputs['weights'] declares the shape [2, 2] (4 elements) but holds 3")
    body = _tensor_request(dense=b"", dtype=sdk_pb.DTYPE_FLOAT32, shape=[-1])
    _refused(body, "data[0].loss_fn_inputs['weights'] has the shape [-1]")
    body = _tensor_request(dense=b"", dtype=sdk_pb.DTYPE_FLOAT32, shape=[0, 1 << 40])
    _refused(body, "has the shape [0, 1099511627776]: every size must lie in")
    body = _tensor_request(dense=b"", dtype=sdk_pb.DTYPE_FLOAT32, shape=[1] * 9)
    _refused(body, "has 9 dimensions, more than 8")


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (sdk_pb.DTYPE_INT32, "DTYPE_INT32"),
        (sdk_pb.DTYPE_BFLOAT16, "DTYPE_BFLOAT16"),
        (sdk_pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"),
        (77, "number 77"),
    ],
)
def test_a_dtype_other_than_float32_or_int64_is_refused(dtype: int, name: str) -> None:
    body = _tensor_request(dense=b"\x00" * 12, dtype=dtype, shape=[3])
    _refused(body, f"data[0].loss_fn_inputs['weights'] has dtype {name}: send float32 or int64")


def _csr(crow: list[int], col: list[int], values: list[float], shape: list[int]) -> bytes:
    csr = sdk_pb.SparseCsr(
        values=np.asarray(values, np.float32).tobytes(),
        crow_indices=np.asarray(crow, np.int64).tobytes(),
        col_indices=np.asarray(col, np.int64).tobytes(),
    )
    return _tensor_request(sparse_csr=csr, dtype=sdk_pb.DTYPE_FLOAT32, shape=shape)


@pytest.mark.parametrize(
    ("crow", "col", "values", "shape", "fragment"),
    [
        ([0, 2, 1, 3], [0, 1, 2], [1, 1, 1], [3, 3], "crow_indices decreases after row 1"),
        ([1, 1, 2, 3], [0, 1, 2], [1, 1, 1], [3, 3], "crow_indices starts at 1"),
        ([0, 1, 3], [0, 1, 2], [1, 1, 1], [3, 3], "crow_indices has 3 entries; a [3, 3] tensor needs rows + 1 = 4"),
        ([0, 1, 2, 3], [0, 1, 3], [1, 1, 1], [3, 3], "holds the column 3, outside the 3 columns"),
        ([0, 1, 2, 3], [0, -1, 2], [1, 1, 1], [3, 3], "holds the column -1"),
        (
            [0, 1, 2, 4],
            [0, 1, 2],
            [1, 1, 1],
            [3, 3],
            "has 3 values and 3 column indices, and its crow_indices end at 4",
        ),
        ([0, 1, 2, 3], [0, 1, 2], [1, 1], [3, 3], "has 2 values and 3 column indices"),
        ([0, 2, 2, 3], [1, 1, 2], [1, 1, 1], [3, 3], "lists row 0's columns out of order or twice"),
        ([0, 0, 2, 2], [2, 0], [1, 1], [3, 3], "lists row 1's columns out of order or twice"),
        ([0, 1], [0], [1], [3], "sparse CSR of shape [3]: a sparse tensor declares a 2-D shape"),
        ([0, 1, 1], [0], [1], [2, 1 << 30], "takes 8589934592 bytes once dense"),
    ],
)
def test_sparse_csr_indices_are_checked_before_densifying(
    crow: list[int], col: list[int], values: list[float], shape: list[int], fragment: str
) -> None:
    error = _refused(_csr(crow, col, values, shape), "data[0].loss_fn_inputs['weights']", fragment)
    assert error.param is not None and error.param.startswith("data[0].loss_fn_inputs['weights']")


def test_sparse_parts_that_are_not_whole_elements_are_refused() -> None:
    csr = sdk_pb.SparseCsr(values=b"\x00" * 4, crow_indices=b"\x00" * 7, col_indices=b"\x00" * 8)
    body = _tensor_request(sparse_csr=csr, dtype=sdk_pb.DTYPE_FLOAT32, shape=[1, 1])
    _refused(body, "data[0].loss_fn_inputs['weights'].sparse_csr.crow_indices is 7 bytes", "int64")


def test_the_inputs_together_may_take_no_more_than_the_body_limit_once_dense() -> None:
    """A sparse tensor is small on the wire and large once dense: the request's inputs, densified, may
    take what a dense body could have held (``max_bytes``), and no more."""
    weights = types.TensorData(
        data=[1.0], dtype="float32", shape=[100, 50], sparse_crow_indices=[0, 1] + [1] * 99, sparse_col_indices=[3]
    )
    body = _request([_datum(list(range(1, 101)), weights=weights) for _ in range(3)]).SerializeToString()
    assert len(body) < 5000
    assert len(_decode(body, max_bytes=60_000).data) == 3  # 3 x 100 x 50 float32
    error = _refused(body, "data[2].loss_fn_inputs['weights'] takes 20000 bytes once dense", max_bytes=59_999)
    assert error.code == "too_large"


def test_bad_loss_fn_config_values_are_refused() -> None:
    message = _request([_datum([1])], config={"clip": 0.2})
    message.loss_fn_config_v2["empty"].SetInParent()
    _refused(message.SerializeToString(), "loss_fn_config_v2['empty'] holds neither a number nor text")
    message = _request([_datum([1])], config={"clip": math.nan})
    _refused(message.SerializeToString(), "loss_fn_config_v2['clip'] is NaN")


def test_a_long_name_from_the_body_is_cut_short_in_messages() -> None:
    message = _request([_datum([1])])
    message.data[0].loss_fn_inputs["w" * 10_000].CopyFrom(sdk_pb.Tensor(dense=b"\x00", dtype=sdk_pb.DTYPE_FLOAT32))
    error = _refused(message.SerializeToString(), "is 1 bytes")
    assert len(str(error)) < 400


def test_random_bytes_and_mutations_give_a_call_or_a_wire_error_only() -> None:
    rng = random.Random(20240611)
    valid = _request(
        [
            _datum([1, 2, 3, 4], target_tokens=np.arange(8, dtype=np.int64).reshape(4, 2)),
            _datum(
                [5, 6, 7],
                target_tokens=types.TensorData(
                    data=[7, 3],
                    dtype="int64",
                    shape=[3, 2],
                    sparse_crow_indices=[0, 1, 1, 2],
                    sparse_col_indices=[1, 0],
                ),
            ),
        ],
        config={"clip": 0.2, "mode": "x"},
    ).SerializeToString()
    compressed = zstandard.ZstdCompressor().compress(valid)
    outcomes = {"ok": 0, "refused": 0}
    for case in range(300):
        encoding: str | None = None
        if case < 60:
            body = rng.randbytes(rng.randrange(0, 200))
            encoding = rng.choice([None, "zstd"])
        else:
            encoding = "zstd" if case % 4 == 0 else None
            mutated = bytearray(compressed if encoding else valid)
            for _ in range(rng.randrange(1, 6)):
                what = rng.random()
                if what < 0.5 and mutated:
                    mutated[rng.randrange(len(mutated))] = rng.randrange(256)
                elif what < 0.7:
                    mutated.insert(rng.randrange(len(mutated) + 1), rng.randrange(256))
                elif what < 0.85 and mutated:
                    del mutated[rng.randrange(len(mutated)) :]
                elif mutated:
                    start = rng.randrange(len(mutated))
                    mutated[start:start] = mutated[start : start + rng.randrange(1, 16)]
            body = bytes(mutated)
        try:
            call = _decode(body, encoding, max_bytes=4096, max_tokens=64)
        except WireError as error:
            assert str(error)
            outcomes["refused"] += 1
        else:
            assert isinstance(call, ForwardBackwardCall)
            outcomes["ok"] += 1
    assert outcomes["refused"] > 100 and outcomes["ok"] + outcomes["refused"] == 300


# Results the SDK reads -----------------------------------------------------------------------------
def test_a_forward_backward_output_reads_back_through_the_sdk() -> None:
    outputs: list[dict[str, np.ndarray]] = [
        {
            "logprobs": np.array([-0.5, -1.25, -2.0], dtype=np.float32),
            "elementwise_loss": np.array([0.5, 1.25, 2.0], dtype=np.float64),  # travels as float32
            "argmax": np.array([4, 5, 6], dtype=np.int32),  # travels as int64
        },
        {
            "logprobs": np.array([-3.0], dtype=np.float32),
            "elementwise_loss": np.array([3.0]),
            "argmax": np.array([7]),
        },
    ]
    metrics = {"loss:sum": 7.0, "tokens:sum": 4, "nan": math.nan}
    result = deserialize_forward_backward_output(encode_forward_backward_output(outputs, metrics))
    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics["loss:sum"] == 7.0 and result.metrics["tokens:sum"] == 4.0
    assert math.isnan(result.metrics["nan"]) and len(result.metrics) == 3
    assert len(result.loss_fn_outputs) == 2
    for ours, theirs in zip(outputs, result.loss_fn_outputs, strict=True):
        assert sorted(theirs) == sorted(ours)
        for name, array in ours.items():
            kind = "float32" if array.dtype.kind == "f" else "int64"
            assert theirs[name].dtype == kind and theirs[name].shape == list(array.shape), name
            assert theirs[name].to_numpy().dtype == np.dtype(kind)
            np.testing.assert_array_equal(theirs[name].to_numpy(), array.astype(kind))


def test_ragged_trailing_shapes_travel_in_records_the_sdk_joins() -> None:
    outputs = [
        {"topk": np.arange(6, dtype=np.float32).reshape(3, 2), "n": np.array([3])},
        {"topk": np.arange(8, dtype=np.float32).reshape(4, 2), "n": np.array([4])},
        {"topk": np.arange(15, dtype=np.float32).reshape(5, 3), "n": np.array([5])},
        {"topk": np.zeros((0, 3), dtype=np.float32), "n": np.array([0])},
        {"topk": np.ones((2, 2, 2), dtype=np.float32), "n": np.array(2)},  # 0-d: one element, shape [1]
    ]
    body = encode_forward_backward_output(outputs, {}, output_type="TopkRecord")
    record_class = wire.message_class("ForwardBackwardOutput")
    assert [r.num_datums for r in record_class.FromString(body).loss_fn_outputs] == [2, 2, 1]
    result = deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "TopkRecord" and result.metrics == {}
    assert [datum["topk"].shape for datum in result.loss_fn_outputs] == [[3, 2], [4, 2], [5, 3], [0, 3], [2, 2, 2]]
    for ours, theirs in zip(outputs, result.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(theirs["topk"].to_numpy(), ours["topk"])
        assert theirs["n"].to_numpy().tolist() == np.atleast_1d(ours["n"]).tolist()


def test_an_empty_output_and_fieldless_datums_read_back() -> None:
    result = deserialize_forward_backward_output(encode_forward_backward_output([], {"loss": 1.0}))
    assert result.loss_fn_outputs == [] and result.metrics == {"loss": 1.0}
    result = deserialize_forward_backward_output(encode_forward_backward_output([{}, {}, {}], {}))
    assert result.loss_fn_outputs == [{}, {}, {}]


def test_outputs_the_server_gets_wrong_are_its_own_value_errors() -> None:
    with pytest.raises(ValueError, match="every datum has the same"):
        encode_forward_backward_output([{"a": np.ones(1)}, {"b": np.ones(1)}], {})
    with pytest.raises(ValueError, match="a result is a float, integer or boolean array"):
        encode_forward_backward_output([{"a": np.array(["x"])}], {})


def test_a_sample_response_reads_back_through_the_sdk() -> None:
    sequences = [
        SampledSequence(tokens=[11, 12, 13], logprobs=[-0.1, -0.2, -0.3], stop_reason="stop"),
        SampledSequence(tokens=[21, 2_000_000_000], logprobs=None, stop_reason="length"),
        SampledSequence(tokens=[], logprobs=[], stop_reason="length"),
    ]
    body = encode_sample_response(
        sequences,
        prompt_logprobs=[None, -1.5, -0.25],
        topk_prompt_logprobs=[[], [(5, -0.5), (6, -1.0)], [(7, -0.1)]],
        prompt_cache_hit_tokens=2,
    )
    result = deserialize_sample_response(body)
    assert len(result.sequences) == 3
    first, second, third = result.sequences
    assert first.stop_reason == "stop" and first.tokens == [11, 12, 13]
    assert first.tokens_np is not None and first.tokens_np.dtype == np.int32
    assert first.logprobs_np is not None and first.logprobs_np.dtype == np.float32
    np.testing.assert_allclose(first.logprobs_np, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert second.stop_reason == "length" and second.tokens == [21, 2_000_000_000] and second.logprobs is None
    assert third.tokens == [] and third.topk_logprobs is None
    assert result.prompt_logprobs_np is not None and result.prompt_logprobs_np.dtype == np.float32
    assert math.isnan(result.prompt_logprobs_np[0])
    assert result.prompt_logprobs == [None, -1.5, -0.25]
    assert result.topk_prompt_logprobs is not None
    assert result.topk_prompt_logprobs[0] is None
    assert result.topk_prompt_logprobs[1] == [(5, -0.5), (6, -1.0)]
    assert result.topk_prompt_logprobs[2] is not None and result.topk_prompt_logprobs[2][0][0] == 7
    assert result.topk_prompt_logprobs_np is not None
    assert result.topk_prompt_logprobs_np.token_ids.shape == (3, 2)
    assert result.topk_prompt_logprobs_np.logprobs[2, 1] == wire.TOPK_EMPTY_LOGPROB
    assert result.prompt_cache_hit_tokens == 2
    assert result.target_prompt_logprobs is None and result.prompt_alt_tokens is None


def test_a_sample_response_without_prompt_logprobs_has_none_and_sampled_topk_reads_back() -> None:
    sequence = SampledSequence(tokens=[1, 2], logprobs=[-1.0, -2.0], topk_logprobs=[[(1, -1.0), (9, -3.0)], None])
    result = deserialize_sample_response(encode_sample_response([sequence]))
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None
    assert result.prompt_cache_hit_tokens == 0
    assert result.sequences[0].topk_logprobs == [[(1, -1.0), (9, -3.0)], None]


def test_sequences_the_server_gets_wrong_are_its_own_value_errors() -> None:
    with pytest.raises(ValueError, match="'eos': 'stop' or 'length'"):
        encode_sample_response([SampledSequence(tokens=[1], stop_reason="eos")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has 2 tokens and 1 logprobs"):
        encode_sample_response([SampledSequence(tokens=[1, 2], logprobs=[-1.0])])
    with pytest.raises(ValueError, match="travel as int32"):
        encode_sample_response([SampledSequence(tokens=[2**31])])
