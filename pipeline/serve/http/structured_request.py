"""The API's structured-output fields as one `StructuredOutput`: OpenAI's `response_format`,
vLLM's `structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields (vLLM removed them in 0.12 and now ignores them, so a
client still sending them gets unconstrained text there; pipe keeps honouring them).

A request names at most one constraint; a malformed one is a `StructuredOutputError` naming the
field at fault (a 400 at the API)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.serve.engine.structured_output import StructuredOutput, StructuredOutputError

# vLLM's StructuredOutputsParams: the keys that constrain, and those that only tune
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
TUNING = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "disable_fallback",
    "whitespace_flexible",
)
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_output_of(body: Any) -> StructuredOutput | None:
    """The constraint a request body asks for (None: free text), its grammar checked."""
    found = []
    if getattr(body, "response_format", None) is not None:
        found.append(("response_format", _response_format(body.response_format)))
    if getattr(body, "structured_outputs", None) is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _constraint(kind, value, field)))
    found = [(field, output) for field, output in found if output is not None]
    if len(found) > 1:
        fields = " and ".join(field for field, _ in found)
        raise StructuredOutputError(f"{fields}: ask for one constraint", param=found[1][0])
    if not found:
        return None
    field, output = found[0]
    try:
        output.grammar()
    except StructuredOutputError as error:
        raise StructuredOutputError(f"{field}: {error}", param=field) from None
    return output


def _response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's `response_format`: text, json_object, or json_schema with a schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise StructuredOutputError(
                "response_format.json_schema: an object with a name and a schema",
                param="response_format",
            )
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutput("json_object")
        return _constraint("json", schema, "response_format.json_schema.schema")
    raise StructuredOutputError(
        f"response_format.type: one of text, json_object, json_schema, not {kind!r}",
        param="response_format",
    )


def _structured_outputs(value: Any) -> StructuredOutput | None:
    """vLLM's `structured_outputs` object: one of its constraint keys."""
    if not isinstance(value, dict):
        raise StructuredOutputError("structured_outputs: an object", param="structured_outputs")
    unknown = sorted(set(value) - set(CONSTRAINTS) - set(TUNING) - {"structural_tag"})
    if unknown:
        raise StructuredOutputError(
            f"structured_outputs: unknown key {unknown[0]!r}", param="structured_outputs"
        )
    if value.get("structural_tag") is not None:
        raise StructuredOutputError(
            "structured_outputs.structural_tag is not supported", param="structured_outputs"
        )
    asked = [key for key in CONSTRAINTS if value.get(key) not in (None, False)]
    if len(asked) > 1:
        raise StructuredOutputError(
            f"structured_outputs: ask for one of {', '.join(asked)}", param="structured_outputs"
        )
    if not asked:
        return None
    key = asked[0]
    return _constraint(key, value[key], f"structured_outputs.{key}")


def _constraint(kind: str, value: Any, where: str) -> StructuredOutput:
    """One constraint from its API value (`where` names the field in errors)."""
    param = where.split(".")[0]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise StructuredOutputError(f"{where}: not valid JSON", param=param) from None
        if not isinstance(value, dict):
            raise StructuredOutputError(f"{where}: a JSON schema object", param=param)
        return StructuredOutput.json_schema(value)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise StructuredOutputError(f"{where}: a non-empty list of strings", param=param)
        return StructuredOutput.choice(value)
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(f"{where}: a non-empty string", param=param)
    return StructuredOutput(kind, value)
