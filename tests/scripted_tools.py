"""A scripted tool-call parser for the multi-turn e2e test (``rl_config.tool_parser_format:
scripted_tools:every_turn``): a tiny random model never writes a hermes tool call, so this
parser finds one in every turn, deterministically from the turn's text, and the real code
interpreter runs it."""

from mindspeed_rl.agent_tools.parser import ParseResult, ToolCall


def every_turn(text: str) -> ParseResult:
    code = f"print({len(text)} * 7)"
    return ParseResult([ToolCall("code_interpreter", {"code": code}, code)], [])
