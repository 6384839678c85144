"""Tools a reinforcement job's model calls during its rollouts: their spec (``spec``), the calls a
model writes (``calls``), running them (``runtime``), the built-ins (``builtins``)."""

from service.tools.calls import Call, Turn, parse, template_format
from service.tools.errors import ToolFailed, ToolSpecError
from service.tools.runtime import Outcome, ToolRunner, Where
from service.tools.spec import MultiTurn, Tool, Toolset, parse_tools, redacted

__all__ = [
    "Call",
    "MultiTurn",
    "Outcome",
    "Tool",
    "ToolFailed",
    "ToolRunner",
    "ToolSpecError",
    "Toolset",
    "Turn",
    "Where",
    "parse",
    "parse_tools",
    "redacted",
    "template_format",
]
