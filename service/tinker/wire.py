"""The Tinker protocol's binary encoding, server side: a ``forward_backward`` body decoded (and refused,
with a ``WireError`` saying where and what to change, when it is not what the SDK sends), and the two
results the SDK reads as protobuf encoded (``ForwardBackwardOutput``, ``SampleResponse``).

The messages are those of the SDK's ``tinker_public.proto``, built field by field in a descriptor pool
of our own (``service.tinker.proto_schema``).

A body arrives raw or zstd-compressed (``Content-Encoding: zstd``, what the SDK sends when its config
says ``proto_compress_fwdbwd``). Everything in it is a stranger's: the decompressed size is capped
while decompressing, the token total is capped, and every byte string is checked against its dtype,
shape and indices before numpy sees it. Bad input raises ``WireError`` and nothing else.

``asample`` requests travel as JSON (the SDK's ``model_dump``), so no sample *request* is decoded here;
its response is protobuf, which ``encode_sample_response`` writes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from service.tinker.proto_schema import PACKAGE, enum_names, message_class

ZSTD_MAX_WINDOW = 8 << 20
"""The largest zstd window a body may ask for: 8 MiB, what RFC 9659 allows the ``zstd`` HTTP content
coding (the SDK's default level uses 2 MiB). It bounds the decoder's memory per request."""
ZSTD_MAX_FRAMES = 16
"""A body is one zstd frame as the SDK writes it; a few concatenated frames are accepted too."""
MAX_DIMS = 8
"""Dimensions a loss input may have (the SDK's are 1-D or 2-D)."""
MAX_DIM = 2**31 - 1
"""The largest size a dimension may have."""

_TOKEN = np.dtype("<i4")  # token ids on the wire: int32 little-endian (np.int32.tobytes() on the SDK's hosts)
_INDEX = np.dtype("<i8")  # CSR indices and BatchedTensor offsets: int64
TOPK_EMPTY_LOGPROB = -99999.0
"""The logprob of an empty top-k cell (token id 0), as the SDK's ``TopkLogprobs`` reads it."""


class WireError(ValueError):
    """A body that is not what the SDK sends: the message says what is wrong, where (``data[2]``,
    ``loss_fn_inputs['weights']``) and what to change. ``param`` is the place as a path, when there is
    one; ``code`` is ``invalid_value``, ``too_large`` (a limit) or ``unsupported_encoding`` (the
    Content-Encoding), for the HTTP layer to answer with the right status."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


_ForwardBackwardRequest = message_class("ForwardBackwardRequest")
_ForwardBackwardOutput = message_class("ForwardBackwardOutput")
_SampleResponse = message_class("SampleResponse")
_TopkLogprobs = message_class("TopkLogprobs")
_DTYPE_NAMES: dict[int, str] = enum_names("DType")
_DTYPE_FLOAT32, _DTYPE_INT64 = 1, 2
_WIRE_DTYPES: dict[int, np.dtype[Any]] = {_DTYPE_FLOAT32: np.dtype("<f4"), _DTYPE_INT64: np.dtype("<i8")}
_NATIVE_DTYPES: dict[int, np.dtype[Any]] = {_DTYPE_FLOAT32: np.dtype(np.float32), _DTYPE_INT64: np.dtype(np.int64)}
_STOP_REASONS = {"stop": 0, "length": 1}


# The request -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireDatum:
    tokens: np.ndarray
    """int64 [T]: the model's input, its text chunks concatenated."""
    loss_fn_inputs: dict[str, np.ndarray]
    """float32 or int64 arrays of the declared shape (a shapeless tensor is 1-D), dense: a sparse CSR
    tensor is densified with 0 in every unlisted cell, as the SDK's ``TensorData.to_numpy()``."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    """The v2 map (numbers and strings) when the body has one, else the legacy map of floats."""
    forward_only: bool
    data: list[WireDatum]


def decode_forward_backward(
    body: bytes, *, content_encoding: str | None, max_bytes: int, max_tokens: int
) -> ForwardBackwardCall:
    """A ``POST /api/v1/forward_backward`` body as the SDK sends it (``Content-Type:
    application/x-protobuf``), decoded and checked; a ``WireError`` for anything else.

    ``max_bytes`` caps the body as it is parsed (after decompression), ``max_tokens`` the tokens of all
    its datums together."""
    payload = _decoded_body(body, content_encoding, max_bytes)
    request = _ForwardBackwardRequest()
    try:
        request.ParseFromString(payload)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise WireError(
            f"the body is not a {PACKAGE}.ForwardBackwardRequest ({exc}): send it as the tinker SDK "
            "encodes it, with Content-Type: application/x-protobuf"
        ) from None
    if not len(request.data):
        raise WireError("the request has no data: send at least one datum", param="data")
    token_bytes = [_datum_token_bytes(i, datum) for i, datum in enumerate(request.data)]
    total = sum(len(piece) for pieces in token_bytes for piece in pieces) // _TOKEN.itemsize
    if total > max_tokens:
        raise WireError(
            f"the request holds {total} tokens over {len(token_bytes)} datums, more than the limit of "
            f"{max_tokens}: send fewer or shorter datums per request",
            param="data",
            code="too_large",
        )
    budget = [max_bytes]  # what the loss inputs may take once dense, all datums together
    data = [
        WireDatum(tokens=_tokens(i, pieces), loss_fn_inputs=_loss_fn_inputs(i, datum, budget))
        for i, (datum, pieces) in enumerate(zip(request.data, token_bytes, strict=True))
    ]
    return ForwardBackwardCall(
        model_id=str(request.model_id),
        seq_id=int(request.seq_id),
        loss_fn=str(request.loss_fn),
        loss_fn_config=_loss_fn_config(request),
        forward_only=bool(request.forward_only),
        data=data,
    )


def _decoded_body(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if len(body) > max_bytes:
        raise WireError(
            f"the body is {len(body)} bytes, more than the limit of {max_bytes}: send fewer datums per request",
            code="too_large",
        )
    if encoding in ("", "identity"):
        return bytes(body)
    if encoding != "zstd":
        raise WireError(
            f"Content-Encoding {_shown(content_encoding or '')} is not served here: send the body as it is, "
            "or zstd-compressed with Content-Encoding: zstd",
            code="unsupported_encoding",
        )
    return _unzstd(bytes(body), max_bytes)


def _unzstd(body: bytes, max_bytes: int) -> bytes:
    """The zstd frames of ``body`` decompressed, refused as soon as they make more than ``max_bytes``.

    A frame's header may declare its size or not (a streaming compressor's), and may lie: the first
    pass reads the stream through a reader that hands out at most ``max_bytes + 1`` bytes, counting
    them and keeping none, so a bomb is stopped at the cap whatever it declares. Only a stream within
    the cap is decompressed again, frame by frame, which also tells a complete frame from one cut
    short (the reader ends a truncated frame silently)."""
    if not body:
        raise WireError("the body is empty, and Content-Encoding: zstd needs a zstd frame: send one")
    decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    produced = 0
    try:
        reader = decompressor.stream_reader(body, read_across_frames=True)
        while produced <= max_bytes:
            piece = reader.read(min(max_bytes + 1 - produced, 1 << 20))
            if not piece:
                break
            produced += len(piece)
        if produced > max_bytes:
            raise WireError(
                f"the zstd body decompresses to more than {max_bytes} bytes, the limit: send fewer datums per request",
                code="too_large",
            )
        out: list[bytes] = []
        rest = body
        for _ in range(ZSTD_MAX_FRAMES):
            frame = decompressor.decompressobj()
            out.append(frame.decompress(rest))
            if not frame.eof:
                raise WireError("the zstd body ends inside a frame (it was cut short): send the whole compressed body")
            rest = frame.unused_data
            if not rest:
                return b"".join(out)
    except zstandard.ZstdError as exc:
        raise WireError(
            f"the body is not valid zstd ({exc}): compress it with a zstd encoder (a window of at most "
            f"{ZSTD_MAX_WINDOW >> 20} MiB, as RFC 9659 asks of HTTP), or send it uncompressed without Content-Encoding"
        ) from None
    raise WireError(f"the zstd body holds more than {ZSTD_MAX_FRAMES} frames: compress it as one frame")


def _datum_token_bytes(i: int, datum: Any) -> list[bytes]:
    """The int32 token bytes of each of the datum's chunks, checked to be whole tokens."""
    pieces = []
    for j, chunk in enumerate(datum.model_input):
        where = f"data[{i}].model_input[{j}]"
        kind = chunk.WhichOneof("chunk")
        if kind in ("image", "dmel"):
            raise WireError(
                f"{where} is {'an image' if kind == 'image' else 'a dmel (audio)'} chunk: images and audio are not "
                "served here: send encoded_text chunks",
                param=where,
            )
        if kind != "encoded_text":
            raise WireError(f"{where} is a chunk of no kind this server knows: send encoded_text chunks", param=where)
        tokens = chunk.encoded_text.tokens
        if len(tokens) % _TOKEN.itemsize:
            raise WireError(
                f"{where}.encoded_text.tokens is {len(tokens)} bytes, not a whole number of int32 token ids "
                "(4 bytes each): send the ids as np.int32 bytes, as the SDK does",
                param=f"{where}.encoded_text.tokens",
            )
        pieces.append(tokens)
    if not any(pieces):
        raise WireError(
            f"data[{i}] has no tokens: its model_input needs at least one encoded_text chunk with a token",
            param=f"data[{i}].model_input",
        )
    return pieces


def _tokens(i: int, pieces: list[bytes]) -> np.ndarray:
    tokens = np.frombuffer(b"".join(pieces), dtype=_TOKEN).astype(np.int64)
    negative = np.flatnonzero(tokens < 0)
    if negative.size:
        position = int(negative[0])
        raise WireError(
            f"data[{i}].model_input holds the token id {int(tokens[position])} at position {position}: "
            "token ids are never negative",
            param=f"data[{i}].model_input",
        )
    return tokens


def _loss_fn_config(request: Any) -> dict[str, float | str]:
    config: dict[str, float | str] = {}
    if len(request.loss_fn_config_v2):
        for key in sorted(request.loss_fn_config_v2):
            value = request.loss_fn_config_v2[key]
            kind = value.WhichOneof("value")
            where = f"loss_fn_config_v2[{_shown(key)}]"
            if kind == "text":
                config[str(key)] = str(value.text)
            elif kind == "number":
                config[str(key)] = _config_number(where, float(value.number))
            else:
                raise WireError(f"{where} holds neither a number nor text: send one of them", param=where)
    else:
        for key in sorted(request.loss_fn_config):
            config[str(key)] = _config_number(f"loss_fn_config[{_shown(key)}]", float(request.loss_fn_config[key]))
    return config


def _config_number(where: str, value: float) -> float:
    if math.isnan(value):
        raise WireError(f"{where} is NaN: send a number", param=where)
    return value


def _loss_fn_inputs(i: int, datum: Any, budget: list[int]) -> dict[str, np.ndarray]:
    inputs = {}
    for name in sorted(datum.loss_fn_inputs):
        where = f"data[{i}].loss_fn_inputs[{_shown(name)}]"
        inputs[str(name)] = _tensor(datum.loss_fn_inputs[name], where, budget)
    return inputs


def _tensor(tensor: Any, where: str, budget: list[int]) -> np.ndarray:
    wire = _WIRE_DTYPES.get(tensor.dtype)
    if wire is None:
        name = _DTYPE_NAMES.get(tensor.dtype, f"number {tensor.dtype}")
        raise WireError(f"{where} has dtype {name}: send float32 or int64 (a TensorData's dtypes)", param=where)
    native = _NATIVE_DTYPES[tensor.dtype]
    shape = [int(size) for size in tensor.shape]
    if len(shape) > MAX_DIMS:
        raise WireError(
            f"{where} has {len(shape)} dimensions, more than {MAX_DIMS}: send a 1-D or 2-D tensor", param=where
        )
    if any(size < 0 or size > MAX_DIM for size in shape):
        raise WireError(f"{where} has the shape {shape}: every size must lie in [0, {MAX_DIM}]", param=where)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _densified(tensor.sparse_csr, wire, native, shape, where, budget)
    data = tensor.dense
    if len(data) % wire.itemsize:
        raise WireError(
            f"{where} is {len(data)} bytes, not a whole number of {wire.name} elements ({wire.itemsize} bytes "
            "each): send the values' bytes in the declared dtype",
            param=where,
        )
    count = len(data) // wire.itemsize
    if not shape:
        shape = [count]  # a TensorData without a shape: 1-D, as the SDK infers it
    if math.prod(shape) != count:
        raise WireError(
            f"{where} declares the shape {shape} ({math.prod(shape)} elements) but holds {count}: "
            "make the shape match the data",
            param=where,
        )
    _spend(budget, count * native.itemsize, where)
    return np.frombuffer(data, dtype=wire).astype(native).reshape(shape)


def _densified(
    csr: Any, wire: np.dtype[Any], native: np.dtype[Any], shape: list[int], where: str, budget: list[int]
) -> np.ndarray:
    """A sparse CSR tensor made dense, 0 in the cells it does not list, once its indices are checked:
    row pointers from 0, never decreasing, ending at the number of values; each row's columns within
    the shape, ascending and listed once (the invariants torch checks)."""
    if len(shape) != 2:
        raise WireError(
            f"{where} is sparse CSR of shape {shape}: a sparse tensor declares a 2-D shape [rows, columns]",
            param=where,
        )
    rows, columns = shape
    parts = {
        "values": (csr.values, wire),
        "crow_indices": (csr.crow_indices, _INDEX),
        "col_indices": (csr.col_indices, _INDEX),
    }
    for part, (raw, dtype) in parts.items():
        if len(raw) % dtype.itemsize:
            raise WireError(
                f"{where}.sparse_csr.{part} is {len(raw)} bytes, not a whole number of {dtype.name} elements "
                f"({dtype.itemsize} bytes each)",
                param=f"{where}.sparse_csr.{part}",
            )
    values = np.frombuffer(csr.values, dtype=wire).astype(native)
    crow = np.frombuffer(csr.crow_indices, dtype=_INDEX).astype(np.int64)
    col = np.frombuffer(csr.col_indices, dtype=_INDEX).astype(np.int64)
    if len(crow) != rows + 1:
        raise WireError(
            f"{where}.sparse_csr.crow_indices has {len(crow)} entries; a [{rows}, {columns}] tensor needs "
            f"rows + 1 = {rows + 1}",
            param=f"{where}.sparse_csr.crow_indices",
        )
    if crow[0] != 0:
        raise WireError(f"{where}.sparse_csr.crow_indices starts at {int(crow[0])}: it starts at 0", param=where)
    steps = np.diff(crow)
    if (steps < 0).any():
        row = int(np.flatnonzero(steps < 0)[0])
        raise WireError(
            f"{where}.sparse_csr.crow_indices decreases after row {row}: row pointers never decrease", param=where
        )
    if int(crow[-1]) != len(col) or len(values) != len(col):
        raise WireError(
            f"{where}.sparse_csr has {len(values)} values and {len(col)} column indices, and its crow_indices end "
            f"at {int(crow[-1])}: the three agree",
            param=where,
        )
    if len(col) and (int(col.min()) < 0 or int(col.max()) >= columns):
        bad = int(col[(col < 0) | (col >= columns)][0])
        raise WireError(
            f"{where}.sparse_csr.col_indices holds the column {bad}, outside the {columns} columns of its shape",
            param=where,
        )
    row_of = np.repeat(np.arange(rows, dtype=np.int64), steps)
    unordered = (row_of[1:] == row_of[:-1]) & (np.diff(col) <= 0)
    if unordered.any():
        row = int(row_of[1:][unordered][0])
        raise WireError(
            f"{where}.sparse_csr lists row {row}'s columns out of order or twice: list each row's columns "
            "once, ascending",
            param=where,
        )
    _spend(budget, rows * columns * native.itemsize, where)
    dense = np.zeros((rows, columns), dtype=native)
    dense[row_of, col] = values
    return dense


def _spend(budget: list[int], size: int, where: str) -> None:
    budget[0] -= size
    if budget[0] < 0:
        raise WireError(
            f"{where} takes {size} bytes once dense, and with the inputs before it that is more than the "
            "request limit: send fewer datums per request",
            param=where,
            code="too_large",
        )


def _shown(text: str, limit: int = 64) -> str:
    """A name from the body, quoted and cut short for a message."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


# The results -------------------------------------------------------------------------------------
def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float], output_type: str = "ArrayRecord"
) -> bytes:
    """A ``ForwardBackwardOutput`` as the SDK's ``deserialize_forward_backward_output`` reads it: one
    dict of arrays a datum (the same names in each), and the step's metrics.

    Floating arrays travel as float32, integer and boolean ones as int64. Each field's datums are cut
    from one buffer at byte offsets, and carry their trailing shape (all but the first dimension); datums
    whose trailing shapes or dtypes differ go in separate records, which the SDK joins. A 0-d array
    travels as one element of shape [1]."""
    message = _ForwardBackwardOutput(loss_fn_output_type=output_type)
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    names = sorted(outputs[0]) if outputs else []
    arrays = []
    for i, output in enumerate(outputs):
        if sorted(output) != names:
            raise ValueError(f"output {i} has the fields {sorted(output)}, output 0 {names}: every datum has the same")
        arrays.append({name: _output_array(output[name], f"outputs[{i}][{name!r}]") for name in names})
    start = 0
    while start < len(arrays):
        kind = _layout(arrays[start])
        end = start + 1
        while end < len(arrays) and _layout(arrays[end]) == kind:
            end += 1
        record = message.loss_fn_outputs.add(type_tag=output_type, num_datums=end - start)
        for name in names:
            chunk = [datum[name] for datum in arrays[start:end]]
            offsets = np.zeros(len(chunk) + 1, dtype=_INDEX)
            offsets[1:] = np.cumsum([array.nbytes for array in chunk])
            field = record.fields[name]
            field.dtype = _DTYPE_FLOAT32 if chunk[0].dtype.kind == "f" else _DTYPE_INT64
            field.trailing_shape.extend(chunk[0].shape[1:])
            field.data = b"".join(array.tobytes() for array in chunk)
            field.offsets = offsets.tobytes()
        start = end
    return bytes(message.SerializeToString())


def _output_array(value: Any, where: str) -> np.ndarray:
    array = np.asarray(value)
    wire: np.dtype[Any]
    if array.dtype.kind == "f":
        wire = np.dtype("<f4")
    elif array.dtype.kind in "iub":
        wire = np.dtype("<i8")
    else:
        raise ValueError(f"{where} is of dtype {array.dtype}: a result is a float, integer or boolean array")
    return np.ascontiguousarray(array.reshape(1) if array.ndim == 0 else array, dtype=wire)


def _layout(datum: Mapping[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((name, array.dtype.str, array.shape[1:]) for name, array in datum.items())


@dataclass(frozen=True)
class SampledSequence:
    """One sampled sequence as the server hands it to ``encode_sample_response``."""

    tokens: list[int]
    logprobs: list[float] | None = None
    """One a token when requested, else None."""
    stop_reason: Literal["stop", "length"] = "stop"
    topk_logprobs: list[list[tuple[int, float]] | None] | None = None
    """When top-k sample logprobs were requested: a token's ``(token id, logprob)`` pairs, best first
    (None where there are none)."""


def encode_sample_response(
    sequences: Sequence[SampledSequence],
    *,
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """A ``SampleResponse`` as the SDK's ``deserialize_sample_response`` reads it: per sequence its
    tokens (int32), logprobs (float32) and stop reason; the prompt's logprobs when requested (float32,
    NaN where there is none: position 0, which has no context); its top-k logprobs when requested (a
    dense [positions, k] matrix, empty cells token 0 and logprob -99999)."""
    message = _SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, sequence in enumerate(sequences):
        if sequence.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason is {sequence.stop_reason!r}: 'stop' or 'length'")
        item = message.sequences.add(
            stop_reason=_STOP_REASONS[sequence.stop_reason], tokens=_token_bytes(sequence.tokens, f"sequences[{i}]")
        )
        if sequence.logprobs is not None:
            if len(sequence.logprobs) != len(sequence.tokens):
                raise ValueError(
                    f"sequences[{i}] has {len(sequence.tokens)} tokens and {len(sequence.logprobs)} logprobs"
                )
            item.logprobs = np.asarray(sequence.logprobs, dtype="<f4").tobytes()
        if sequence.topk_logprobs is not None:
            item.topk_sampled_logprobs.CopyFrom(_topk(sequence.topk_logprobs))
    if prompt_logprobs is not None:
        filled = [math.nan if value is None else float(value) for value in prompt_logprobs]
        message.prompt_logprobs = np.asarray(filled, dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt_logprobs))
    return bytes(message.SerializeToString())


def _token_bytes(tokens: Sequence[int], where: str) -> bytes:
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np.int32).max):
        raise ValueError(f"{where} holds a token id outside [0, 2**31): token ids travel as int32")
    return ids.astype("<i4").tobytes()


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None]) -> Any:
    k = max((len(row) for row in rows if row), default=0)
    token_ids = np.zeros((len(rows), k), dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            token_ids[i, j], logprobs[i, j] = token, logprob
    return _TopkLogprobs(token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))
