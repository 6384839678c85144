"""The messages of the Tinker SDK's ``tinker_public.proto`` (package ``tinker_public``, proto3) that
the server reads and writes, built field for field, in the SDK's numbering, in a descriptor pool
of this module's own (``service.tinker.wire`` encodes and decodes with them). The server never
imports the SDK, and a process that holds both (the tests) never sees two registrations of one
file clash. A field the SDK sends that is not built here would be kept as an unknown field and
ignored. ``tests/unit/test_tinker_wire.py`` compares this file with the SDK's, field by field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
FILE_NAME = "tinker_public.proto"


# The messages ------------------------------------------------------------------------------------
_F = descriptor_pb2.FieldDescriptorProto
_BYTES, _STRING, _BOOL = _F.TYPE_BYTES, _F.TYPE_STRING, _F.TYPE_BOOL
_DOUBLE, _INT32, _INT64, _UINT32 = _F.TYPE_DOUBLE, _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32
_MESSAGE, _ENUM = _F.TYPE_MESSAGE, _F.TYPE_ENUM


class _Field(NamedTuple):
    name: str
    number: int
    type: int
    type_name: str | None = None  # a message or enum of the package, "Datum.LossFnInputsEntry" for a nested one
    repeated: bool = False
    oneof: str | None = None  # a real oneof's name
    optional: bool = False  # proto3 ``optional``: a synthetic oneof ``_<name>`` of its own


def _message(
    name: str, *fields: _Field, oneofs: Sequence[str] = (), nested: Sequence[descriptor_pb2.DescriptorProto] = ()
) -> descriptor_pb2.DescriptorProto:
    """A message's descriptor; real oneofs are declared first and the synthetic ones of proto3
    ``optional`` fields after them, in field order, as protoc lays them out."""
    message = descriptor_pb2.DescriptorProto(name=name)
    declared = [*oneofs, *(f"_{field.name}" for field in fields if field.optional)]
    for oneof in declared:
        message.oneof_decl.add(name=oneof)
    for field in fields:
        label = _F.LABEL_REPEATED if field.repeated else _F.LABEL_OPTIONAL
        proto = message.field.add(name=field.name, number=field.number, type=field.type, label=label)
        if field.type_name is not None:
            proto.type_name = f".{PACKAGE}.{field.type_name}"
        if field.oneof is not None:
            proto.oneof_index = declared.index(field.oneof)
        if field.optional:
            proto.oneof_index = declared.index(f"_{field.name}")
            proto.proto3_optional = True
    message.nested_type.extend(nested)
    return message


def _map_entry(name: str, value: _Field) -> descriptor_pb2.DescriptorProto:
    """The nested ``<Name>Entry`` message protoc writes for a ``map<string, value>`` field."""
    entry = _message(name, _Field("key", 1, _STRING), value._replace(name="value", number=2))
    entry.options.map_entry = True
    return entry


def _enum(name: str, *values: str) -> descriptor_pb2.EnumDescriptorProto:
    enum = descriptor_pb2.EnumDescriptorProto(name=name)
    for number, value in enumerate(values):
        enum.value.add(name=value, number=number)
    return enum


def _tensors() -> list[descriptor_pb2.DescriptorProto]:
    """A tensor: dense bytes or sparse CSR, in a dtype, of a shape."""
    return [
        _message(
            "SparseCsr",
            _Field("values", 1, _BYTES),
            _Field("crow_indices", 2, _BYTES),
            _Field("col_indices", 3, _BYTES),
        ),
        _message(
            "Tensor",
            _Field("dense", 1, _BYTES, oneof="encoding"),
            _Field("sparse_csr", 2, _MESSAGE, "SparseCsr", oneof="encoding"),
            _Field("dtype", 3, _ENUM, "DType"),
            _Field("shape", 4, _INT64, repeated=True),
            oneofs=["encoding"],
        ),
    ]


def _inputs() -> list[descriptor_pb2.DescriptorProto]:
    """The model's input (chunks, of which only encoded text is served), a datum, and the provenance
    the SDK may attach to it (read past, never used)."""
    return [
        _message(
            "Chunk",
            _Field("encoded_text", 1, _MESSAGE, "EncodedTextChunk", oneof="chunk"),
            _Field("image", 2, _MESSAGE, "ImageChunk", oneof="chunk"),
            _Field("dmel", 3, _MESSAGE, "DmelChunk", oneof="chunk"),
            oneofs=["chunk"],
        ),
        _message("EncodedTextChunk", _Field("tokens", 1, _BYTES)),
        _message(
            "ImageChunk",
            _Field("data", 1, _BYTES),
            _Field("format", 2, _STRING),
            _Field("expected_tokens", 3, _INT32, optional=True),
            _Field("override_dimensions", 4, _MESSAGE, "ImageDimensions", optional=True),
        ),
        _message("ImageDimensions", _Field("width", 1, _UINT32), _Field("height", 2, _UINT32)),
        _message("DmelChunk", _Field("dmel", 1, _BYTES)),
        _message(
            "Datum",
            _Field("model_input", 1, _MESSAGE, "Chunk", repeated=True),
            _Field("loss_fn_inputs", 2, _MESSAGE, "Datum.LossFnInputsEntry", repeated=True),
            _Field("model_input_spans", 3, _MESSAGE, "ProvenanceSpan", repeated=True),
            _Field("loss_fn_input_spans", 4, _MESSAGE, "ProvenanceSpan", repeated=True),
            nested=[_map_entry("LossFnInputsEntry", _Field("value", 2, _MESSAGE, "Tensor"))],
        ),
        _message(
            "ProvenanceSpan",
            _Field("prompt_tokens", 1, _MESSAGE, "PromptProvenanceSpan", oneof="span"),
            _Field("sampled_tokens", 2, _MESSAGE, "SampledProvenanceSpan", oneof="span"),
            oneofs=["span"],
        ),
        *(
            _message(name, _Field("sequence_id", 1, _STRING), _Field("offset", 2, _INT64), _Field("length", 3, _INT64))
            for name in ("PromptProvenanceSpan", "SampledProvenanceSpan")
        ),
    ]


def _forward_backward() -> list[descriptor_pb2.DescriptorProto]:
    """The request, and its result: per field, every datum's values in one buffer, cut at byte offsets."""
    return [
        _message(
            "LossConfigValue",
            _Field("number", 1, _DOUBLE, oneof="value"),
            _Field("text", 2, _STRING, oneof="value"),
            oneofs=["value"],
        ),
        _message(
            "ForwardBackwardRequest",
            _Field("model_id", 1, _STRING),
            _Field("seq_id", 2, _INT32),
            _Field("data", 3, _MESSAGE, "Datum", repeated=True),
            _Field("loss_fn", 4, _STRING),
            _Field("loss_fn_config", 5, _MESSAGE, "ForwardBackwardRequest.LossFnConfigEntry", repeated=True),
            _Field("forward_only", 6, _BOOL),
            _Field("loss_fn_config_v2", 7, _MESSAGE, "ForwardBackwardRequest.LossFnConfigV2Entry", repeated=True),
            nested=[
                _map_entry("LossFnConfigEntry", _Field("value", 2, _DOUBLE)),
                _map_entry("LossFnConfigV2Entry", _Field("value", 2, _MESSAGE, "LossConfigValue")),
            ],
        ),
        _message(
            "BatchedTensor",
            _Field("data", 1, _BYTES),
            _Field("offsets", 2, _BYTES),
            _Field("dtype", 3, _ENUM, "DType"),
            _Field("trailing_shape", 4, _INT64, repeated=True),
        ),
        _message(
            "ArrayRecord",
            _Field("type_tag", 1, _STRING),
            _Field("fields", 2, _MESSAGE, "ArrayRecord.FieldsEntry", repeated=True),
            _Field("num_datums", 3, _INT64),
            nested=[_map_entry("FieldsEntry", _Field("value", 2, _MESSAGE, "BatchedTensor"))],
        ),
        _message(
            "ForwardBackwardOutput",
            _Field("loss_fn_output_type", 1, _STRING),
            _Field("loss_fn_outputs", 2, _MESSAGE, "ArrayRecord", repeated=True),
            _Field("metrics", 3, _MESSAGE, "ForwardBackwardOutput.MetricsEntry", repeated=True),
            nested=[_map_entry("MetricsEntry", _Field("value", 2, _DOUBLE))],
        ),
    ]


def _sample_response() -> list[descriptor_pb2.DescriptorProto]:
    """A sample's result."""
    return [
        _message(
            "TopkLogprobs",
            _Field("token_ids", 1, _BYTES),
            _Field("logprobs", 2, _BYTES),
            _Field("k", 3, _UINT32),
            _Field("length", 4, _UINT32),
        ),
        _message(
            "SampledSequence",
            _Field("stop_reason", 1, _ENUM, "StopReason"),
            _Field("tokens", 2, _BYTES),
            _Field("logprobs", 3, _BYTES, optional=True),
            _Field("topk_sampled_logprobs", 4, _MESSAGE, "TopkLogprobs", optional=True),
        ),
        _message("PromptAltTokens", _Field("tokens", 1, _MESSAGE, "Tensor"), _Field("logprobs", 2, _MESSAGE, "Tensor")),
        _message(
            "SampleResponse",
            _Field("sequences", 1, _MESSAGE, "SampledSequence", repeated=True),
            _Field("prompt_logprobs", 2, _BYTES, optional=True),
            _Field("topk_prompt_logprobs", 3, _MESSAGE, "TopkLogprobs", optional=True),
            _Field("prompt_cache_hit_tokens", 4, _INT32),
            _Field("target_prompt_logprobs", 5, _MESSAGE, "Tensor", optional=True),
            _Field("prompt_alt_tokens", 6, _MESSAGE, "PromptAltTokens", optional=True),
        ),
    ]


def _file() -> descriptor_pb2.FileDescriptorProto:
    """The part of ``tinker_public.proto`` the server reads and writes, in the SDK's order."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    proto.enum_type.extend(
        [
            _enum("StopReason", "STOP_REASON_STOP", "STOP_REASON_LENGTH"),
            _enum("DType", "DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"),
        ]
    )
    proto.message_type.extend([*_tensors(), *_inputs(), *_forward_backward(), *_sample_response()])
    return proto


FILE_DESCRIPTOR = _file()
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(FILE_DESCRIPTOR)


def message_class(name: str) -> Any:
    """The class of the package's message ``name`` (``"Tensor"``, ``"Datum.LossFnInputsEntry"``), from
    this module's own pool."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


def enum_names(name: str) -> dict[int, str]:
    """The package's enum ``name``: its values' names by number."""
    return {value.number: value.name for value in _POOL.FindEnumTypeByName(f"{PACKAGE}.{name}").values}
