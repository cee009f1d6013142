"""Structured output on the real model (SmolLM2-135M-Instruct): a dozen JSON schemas (nested objects, enums, arrays,
numbers, patterns, optional, nullable and alternative fields) each give a text that parses and validates under its
schema (`jsonschema`), in process (`Model.chat(grammar=...)`) and through `llama-jax serve` with the `openai`
client's response_format (json_schema strict, json_object), streamed and not, all at once, the same text as in
process; llama-server's grammar (GBNF) and json_schema fields; a schema that does not compile is a 400 naming it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from llama_jax import Grammar, Sampling

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {  # name: (question, schema)
    "person": ("Describe a person as JSON with a name and an age.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}),
    "enum": ("What color is the sky? Answer in JSON.", {
        "type": "object", "required": ["color"], "properties": {"color": {"enum": ["red", "green", "blue"]}}}),
    "nested": ("Give the address of a museum in Paris as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["museum", "address"], "properties": {
            "museum": NAME, "address": {
                "type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                "properties": {"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
    "array": ("List three fruits as a JSON array of strings.", {
        "type": "array", "items": NAME, "minItems": 1, "maxItems": 3}),
    "numbers": ("Give the price in dollars and the quantity of an order of apples as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["price", "quantity"], "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99}}}),
    "boolean": ("Is water wet? Answer in JSON with a boolean field answer and a short reason.", {
        "type": "object", "additionalProperties": False, "required": ["answer", "reason"],
        "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 40}}}),
    "objects": ("List two books with their number of pages as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["books"], "properties": {"books": {
            "type": "array", "minItems": 1, "maxItems": 2, "items": {
                "type": "object", "additionalProperties": False, "required": ["title", "pages"],
                "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}}}}}}),
    "optional": ("Describe a city as JSON (name, and optionally its population).", {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 40000000}}}),
    "pattern": ("Give the three-letter code of a currency as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    "any_of": ("Give an identifier, a number or a name, as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, NAME]}}}),
    "nullable": ("Give the middle name of Albert Einstein as JSON, null if none.", {
        "type": "object", "additionalProperties": False, "required": ["middle"],
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 24}}}),
    "enum_numbers": ("Rate the movie Titanic from 1 to 5 in JSON, with a one-word verdict.", {
        "type": "object", "additionalProperties": False, "required": ["stars", "verdict"],
        "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "verdict": {"type": "string", "enum": ["good", "bad"]}}}),
}  # fmt: skip
MAX_TOKENS = 160


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def answers(model) -> dict[str, str]:
    """Each schema's greedy answer in process."""
    return {
        name: model.chat(_messages(question), MAX_TOKENS, grammar=Grammar.json_schema(schema))
        for name, (question, schema) in SCHEMAS.items()
    }


def test_every_schema_s_answer_in_process_validates(model, answers):
    for name, (_, schema) in SCHEMAS.items():
        jsonschema.validate(json.loads(answers[name]), schema)
    sampled = Sampling(0.9, None, 0.95, 7, grammar=Grammar.json_schema(SCHEMAS["objects"][1]))
    jsonschema.validate(json.loads(model.chat(_messages(SCHEMAS["objects"][0]), MAX_TOKENS, sampling=sampled)),
                        SCHEMAS["objects"][1])  # fmt: skip
    assert isinstance(json.loads(model.chat(_messages("Describe Paris."), MAX_TOKENS, grammar=Grammar.json_object())),
                      dict)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from tests.served import Served

    served = Served(tmp_path_factory.mktemp("structured"), "--max-batch", "4")
    yield served
    assert served.stop(), served.log.read_text()[-3000:]


def test_the_openai_client_s_response_format_gets_the_in_process_answers_streamed_and_not(server, answers, model):
    """Every schema as response_format json_schema (strict), non-streamed and streamed, 24 requests at once over 4
    slots: each text is the in-process answer, bit for bit, and validates; json_object gives a JSON object."""
    from openai import OpenAI

    from tests.served import NAME as MODEL

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def ask(name: str, stream: bool) -> str:
        question, schema = SCHEMAS[name]
        format_ = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        reply = client.chat.completions.create(model=MODEL, messages=_messages(question), max_tokens=MAX_TOKENS,
                                               temperature=0, response_format=format_, stream=stream)  # fmt: skip
        if not stream:
            assert reply.choices[0].finish_reason == "stop"
            return reply.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)

    jobs = [(name, stream) for name in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda job: ask(*job), jobs))
    for (name, _), text in zip(jobs, texts, strict=True):
        assert text == answers[name], name
        jsonschema.validate(json.loads(text), SCHEMAS[name][1])
    anything = client.chat.completions.create(
        model=MODEL,
        messages=_messages("Describe Paris."),
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_llama_server_s_grammar_and_json_schema_fields_constrain_completions(server):
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    reply = server.post("/v1/completions", {"prompt": "Is Paris in France?", "grammar": gbnf, "max_tokens": 20})
    assert reply.json()["choices"][0]["text"] in ("The answer is yes.", "The answer is no."), reply.text
    schema = SCHEMAS["enum"][1]
    reply = server.post("/v1/completions", {"prompt": "The sky as JSON:", "json_schema": schema, "max_tokens": 20})
    jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    "fields, param, problem",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format",
         "Invalid type"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format must be"),
        ({"grammar": 'root ::= "a" missing'}, "grammar", "Rule 'missing' not found"),
        ({"json_schema": "not a schema"}, "json_schema", "not valid JSON"),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema", "not several"),
    ],
)  # fmt: skip
def test_a_grammar_that_does_not_compile_is_a_400_naming_it(server, fields, param, problem):
    for path, body in [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": _messages("Hi")})]:
        reply = server.post(path, {**body, **fields})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and problem in error["message"], error
