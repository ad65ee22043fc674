"""No constraint can end or hold the server. A live `nanoserve serve` in a child process (so that a
crash fails these tests, not the suite) is sent the constraints that ended or misled it before:
a Lark grammar of 3,000 chained rules (a segfault), schemas that refer to themselves with no way
out (a 200 with empty content), 100,000 choices (a panic's backtrace in the message); then a
derandomized property test of random schemas, regexes, Lark and GBNF grammars and choice lists,
deep, long, circular and huge among them: every answer is a 400 naming the field, or a 200 whose
output keeps its constraint. The checker's child process is tested alone: a crash or a compile
past its time limit is a GrammarError, and the next check runs on a new child."""

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.grammar.checker import GrammarChecker
from nanoserve.grammar.compile import closed_schema
from nanoserve.grammar.limits import (
    MAX_CHOICES,
    MAX_RULES,
    MAX_SCHEMA_DEPTH,
    GrammarError,
    check_sizes,
    has_instance,
)
from nanoserve.tokenizer import Tokenizer

C = "/v1/completions"
WAIT_S = 60.0
LEAKS = ("panic", "backtrace", "<state>", ".rs:", "Traceback")


@dataclass
class Server:
    process: subprocess.Popen
    http: httpx.Client
    log: list[str] = field(default_factory=list)

    def complete(self, constraint: dict, max_tokens: int = 12, seed: int = 0) -> httpx.Response:
        body = {"prompt": "The answer:", "max_tokens": max_tokens, "seed": seed,
                "structured_outputs": constraint}  # fmt: skip
        return self.http.post(C, json=body)

    def alive(self) -> None:
        assert self.process.poll() is None, "\n".join(self.log[-30:])
        assert self.http.get("/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[Server]:
    command = [sys.executable, "-m", "nanoserve.cli", "serve", str(tiny_model_dir), "--port",
               "0", "--num-kv-blocks", "256"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    log: list[str] = []
    for line in process.stderr:
        log.append(line)
        if "ready: " in line:
            break
    else:
        pytest.fail("".join(log))
    url = line.split("ready: ", 1)[1].split()[0]
    # Keep reading its log, so that a full pipe never blocks the server.
    drain = threading.Thread(target=log.extend, args=(process.stderr,), name="server-log")
    drain.start()
    try:
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            yield Server(process, http, log)
    finally:
        process.kill()
        process.wait()
        drain.join(timeout=WAIT_S)


def refused(response: httpx.Response, field_name: str) -> str:
    """The message of a 400 that names `field_name` and leaks no compiler internals."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"] or "").startswith(field_name), error
    assert not any(leak in error["message"] for leak in LEAKS), error["message"]
    return error["message"]


def chain(rules: int) -> str:
    lines = [f'r{i}: "t{i}" r{i + 1} | "e"' for i in range(rules)]
    return "\n".join(["start: r0", *lines, f'r{rules}: "z"'])


# -- the constraints that ended or misled the server -------------------------------------------


def test_a_grammar_of_3000_chained_rules_is_a_400_and_the_server_lives(server):
    message = refused(server.complete({"grammar": chain(3000)}), "structured_outputs")
    assert f"at most {MAX_RULES} rules" in message
    server.alive()
    ok = server.complete({"grammar": chain(50)})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        {"enum": []},
    ],
)
def test_a_schema_nothing_satisfies_is_a_400(server, schema):
    message = refused(server.complete({"json": schema}), "structured_outputs")
    assert "no JSON value satisfies" in message


def test_a_recursive_schema_with_a_way_out_is_taken(server):
    schema = {"type": "object", "required": ["next"],
              "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}  # fmt: skip
    response = server.complete({"json": schema}, max_tokens=40)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("depth", [8, 60, 200])
def test_a_deeply_nested_tool_schema_is_answered_at_once(server, depth):
    """Each level of a tool's schema is read once (reading `properties` twice a level took
    2**60 steps on the event loop at 60 levels: the server hung)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 4}  # fmt: skip
    response = server.http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        refused(response, "")  # a 400 (too deep to parse, or to compile), never a leak
    server.alive()


def test_100000_choices_are_a_400_without_a_backtrace(server):
    choices = [f"option {i}" for i in range(100_000)]
    message = refused(server.complete({"choice": choices}), "structured_outputs")
    assert f"at most {MAX_CHOICES} options" in message
    server.alive()


@pytest.mark.parametrize(
    ("constraint", "limit"),
    [
        ({"regex": "a{1000000}"}, "repetition counts at most"),
        ({"grammar": 'start: "a"~100000'}, "repetition counts at most"),
        ({"json": {"type": "string", "pattern": "[0-9]{99999}"}}, "repetition counts at most"),
        ({"json": {"type": "object", "properties": {f"p{i}": {} for i in range(2000)}}},
         "properties in one object"),
        ({"grammar": "x" * 300_000}, "characters"),
    ],
)  # fmt: skip
def test_sizes_over_a_limit_are_named(server, constraint, limit):
    assert limit in refused(server.complete(constraint), "structured_outputs")


def test_a_schema_nested_past_the_limit_is_named():
    schema: dict = {"type": "string"}
    for _ in range(3000):  # deeper than Python's recursion limit
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match=f"nested at most {MAX_SCHEMA_DEPTH} deep"):
        check_sizes("json", schema, "response_format")
    text = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000
    with pytest.raises(GrammarError, match="nested at most"):
        check_sizes("json", text, "response_format")


def test_which_schemas_have_an_instance():
    assert has_instance({"type": "object", "properties": {"a": {"$ref": "#"}}})  # a is optional
    assert has_instance({"type": "array", "items": {"$ref": "#"}})  # [] ends it
    assert not has_instance({"type": "array", "items": {"$ref": "#"}, "minItems": 1})
    assert not has_instance({"anyOf": [{"$ref": "#"}, {"enum": []}]})
    assert has_instance({"anyOf": [{"$ref": "#"}, {"type": "string"}]})
    assert has_instance({"$ref": "https://example.com/schema"})  # not local: the compiler judges


# -- the checker's child process ---------------------------------------------------------------


@pytest.fixture
def checker(tiny_model_dir, request) -> Iterator[GrammarChecker]:
    """A checker of the tiny model's vocabulary; its time limit is the test's parameter."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    setup = {"tokenizer": tokenizer.backend_json(), "n_vocab": tokenizer.vocab_size, "eos": [0]}
    checker = GrammarChecker(lambda: setup, seconds=request.param)
    yield checker
    checker.close()


@pytest.mark.parametrize("checker", [60.0], indirect=True)  # time to reach the overflow
def test_a_crash_in_the_compiler_is_a_grammar_error_and_the_next_check_runs(checker):
    # Past the size limits (which the server checks first): this chain overflows the
    # child's stack.
    with pytest.raises(GrammarError, match="the grammar compiler failed") as failed:
        checker.check("grammar", chain(20_000), None, "structured_outputs")
    assert failed.value.param == "structured_outputs"
    checker.check("grammar", chain(10), None, "structured_outputs")


@pytest.mark.parametrize("checker", [0.5], indirect=True)
def test_a_compile_past_its_time_limit_is_a_grammar_error_and_the_next_check_runs(checker):
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}
    with pytest.raises(GrammarError, match="took more than 0.5 s to compile"):
        checker.check("json", slow, None, "response_format.json_schema.schema")
    checker.check("json", {"type": "integer"}, None, "response_format.json_schema.schema")


# -- random constraints ------------------------------------------------------------------------

EXAMPLES = 40
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = st.sampled_from(["a", "b", "name", "x-y", "é"])
LEAVES = st.one_of(
    st.just({"type": "string", "maxLength": 6}),
    st.just({"type": "integer", "minimum": 0, "maximum": 99}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue"]), max_size=3).map(lambda v: {"enum": v}),
    st.just({"$ref": "#"}),
)


def _object(children):
    return st.dictionaries(NAMES, children, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props) or ["a"]), max_size=3).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(set(required) & set(props)),
            }  # fmt: skip
        )
    )


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _object(children),
        st.builds(
            lambda items, n: {"type": "array", "items": items, "minItems": n},
            children,
            st.integers(0, 2),
        ),  # fmt: skip
        st.lists(children, min_size=1, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=8,
)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HARD_SCHEMAS = st.sampled_from(
    [_nested(10), _nested(MAX_SCHEMA_DEPTH // 2 - 1), _nested(40), _nested(3000),
     {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     {"type": "array", "items": {"type": "integer"}, "minItems": 10**9},
     {"type": "string", "minLength": 5, "maxLength": 2},
     {"type": "string", "pattern": "(x+x+)+y"}]
)  # fmt: skip
REGEXES = st.one_of(
    st.lists(
        st.sampled_from(["a", "[0-9]", "(ab|cd)", "x+", "[a-z]{2,5}", "(y|z)*", "-", r"\d{3}"]),
        min_size=1, max_size=5,
    ).map("".join),
    st.sampled_from(["a{4096}", "a{4097}", "a{1000000}", "(x+x+)+y", "(" * 300 + "a" + ")" * 300,
                     "((a{100}){100}){100}", "[", "a**", ""]),
)  # fmt: skip
LARK = st.one_of(
    st.integers(1, 1100).map(chain),
    st.sampled_from([
        'start: start "a" | "a"',  # left-recursive
        'start: e\ne: e "+" e | e e | "x"',  # ambiguous
        'start: a\na: "x" a',  # no end
        'start: "a" | ',
        "start: " + " | ".join(f'"w{i}"' for i in range(3000)),
        "start: " + "(" * 400 + '"a"' + ")" * 400,
        'start: "unclosed',
        "start: undefined_rule",
    ]),
)  # fmt: skip
GBNF = st.sampled_from(
    ['root ::= "yes" | "no"', 'root ::= [0-9]+ "." [0-9]+', "root ::= item\nitem ::= item",
     "root ::= " + " ".join(f"r{i}" for i in range(10)) + "\n"
     + "\n".join(f'r{i} ::= "{i}"' for i in range(10)), "root ::= (", 'root ::= "a"{5000}']
)  # fmt: skip
CHOICES = st.one_of(
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=6),
    st.sampled_from([MAX_CHOICES, MAX_CHOICES + 1, 50_000]).map(
        lambda n: [f"c{i}" for i in range(n)]
    ),
    st.just([""]),
)
CONSTRAINTS = st.one_of(
    st.tuples(st.just("json"), st.one_of(SCHEMAS, HARD_SCHEMAS)),
    st.tuples(st.just("regex"), REGEXES),
    st.tuples(st.just("grammar"), st.one_of(LARK, GBNF)),
    st.tuples(st.just("choice"), CHOICES),
)


def keeps(kind: str, value, text: str) -> bool:
    """Whether a whole output matches its constraint (Lark and GBNF are left to the server)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
        return True
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    return True


@PROPERTY
@given(constraint=CONSTRAINTS, seed=st.integers(0, 2**31))
def test_every_answer_is_a_named_400_or_keeps_its_constraint(server, constraint, seed):
    kind, value = constraint
    response = server.complete({kind: value}, seed=seed)
    if response.status_code != 200:
        refused(response, "structured_outputs")
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice
        if choice["finish_reason"] == "stop":  # a whole output: it matches
            assert keeps(kind, value, choice["text"]), choice
    server.alive()


def test_an_embedded_schema_is_no_grammar_syntax():
    """A tool's description may say "~5000": only the grammar's own `~n` is a repetition."""
    check_sizes("grammar", 'start: body\nbody: %json {"description": "~5000 words"}', "tools")
    with pytest.raises(GrammarError, match="repetition counts at most"):
        check_sizes("grammar", 'start: "a"~5000', "tools")


def test_a_property_named_like_a_keyword_is_closed_as_any_other():
    schema = {"type": "object", "properties": {"const": {"type": "object"}}}
    assert closed_schema(schema)["properties"]["const"]["additionalProperties"] is False
