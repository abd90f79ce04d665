"""Malformed rule files and options: one line naming the problem, exit 2, nothing written."""

from __future__ import annotations

import copy
import functools
import hashlib
import json

import pytest
from taso_jax.search.rules import RuleFileError, default_substitutions, load_substitutions

from taso_jax.cli import main


@functools.cache
def _shipped_rule() -> dict:
    # Read once: the cases below are built at import, and reading the shipped file 36 times
    # took 18 s of every run's collection.
    return next(s.to_json() for s in default_substitutions()
                if len(s.source) >= 2 and any(n.attrs for n in s.source))


def _rule() -> dict:
    """A shipped rule of two source nodes with attributes, in its file form, without id."""
    rule = copy.deepcopy(_shipped_rule())
    rule.pop("id")
    return rule


def _doc(*rules) -> dict:
    return {"format": "taso_jax.substitutions", "version": 1, "generator": {},
            "substitutions": list(rules)}


def _edited(**fields) -> dict:
    return _doc({**_rule(), **fields})


def _node_edit(**fields) -> dict:
    rule = _rule()
    rule["source"] = copy.deepcopy(rule["source"])
    rule["source"][0].update(fields)
    return _doc(rule)


def _inputs(first: str) -> dict:
    inputs = _rule()["source"][0]["inputs"]
    return _node_edit(inputs=[first, *inputs[1:]])


def _sizes(value) -> dict:
    return _edited(variables={k: [value, *v[1:]] for k, v in _rule()["variables"].items()})


def _attrs(value) -> dict:
    return _node_edit(attrs={k: value for k in _rule()["source"][0]["attrs"]})


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


#: case -> (file text or JSON value, words the error line holds)
CASES = {
    "deep_document": (_nested(100_000), "nested too deep"),
    "deep_inside_a_rule": (json.dumps(_edited(provenance={})).replace(
        '"provenance": {}', '"provenance": {"x": ' + _nested(50_000) + "}"),
        "nested too deep"),
    "deep_attribute": (_attrs(json.loads(_nested(20))), "nested more than"),
    "node_refers_to_itself": (_inputs("#0"), "refers to its own node"),
    "node_refers_to_a_later_node": (_inputs("#1"), "refers to a later node"),
    "node_refers_past_the_end": (_inputs("#99"), "is not a node of the source"),
    "output_index_too_large": (_edited(outputs=[["#0.5", "#0"]]), "has 1 output"),
    "undeclared_variable": (_edited(outputs=[["#0", "zz"]]), "not a declared variable"),
    "source_output_is_a_variable": (_edited(outputs=[["x", "x"]]), "must be a node"),
    "size_1e400": (_sizes(1e400), "not the number inf"),
    "size_nan": (_sizes(float("nan")), "not the number nan"),
    "size_10_to_300": (_sizes(10 ** 300), "larger than int64"),
    "negative_size": (_sizes(-3), "is not from 0"),
    "version_of_5000_digits": (json.dumps(_doc()).replace('"version": 1',
                                                          '"version": ' + "9" * 5000),
                               "5,000 digits"),
    "attribute_10_to_400": (_attrs(10 ** 400), "larger than int64"),
    "attribute_nan": (_attrs(float("nan")), "is NaN"),
    "attribute_object": (_attrs({"a": 1}), "attribute value must be"),
    "source_a_string": (_edited(source="abc"), "'source' must be a list"),
    "node_a_number": (_edited(source=[1, 2]), "a node must be an object"),
    "inputs_numbers": (_node_edit(inputs=[5, 6]), "input reference must be a string"),
    "operator_a_list": (_node_edit(op=["x"]), "'op' must be a string"),
    "unknown_operator": (_node_edit(op="frobnicate"), "unknown operator"),
    "wrong_arity": (_node_edit(inputs=[]), "inputs, not 0"),
    "name_a_number": (_edited(name=5), "'name' must be a string"),
    "outputs_triples": (_edited(outputs=[["#0", "#0", "#0"]]), "a pair of references"),
    "no_outputs": (_edited(outputs=[]), "at least one output"),
    "rules_an_object": ({**_doc(), "substitutions": {"a": 1}}, "must be a list of rules"),
    "rule_null": (_doc(None), "must be an object, not null"),
    "version_a_string": ({**_doc(), "version": "2"}, "is not an integer"),
    "proof_a_string": (_edited(provenance={"proof": "proved"}), "'provenance.proof'"),
    "top_level_list": ([1, 2], "not a taso_jax substitution file"),
    "empty_file": ("", "Expecting value"),
    "not_utf8": (b"\xff\xfe\x00\x01", "can't decode"),
}


def _write(tmp_path, case: str):
    content = CASES[case][0]
    path = tmp_path / f"{case}.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _one_line_exit_2(capsys, rc: int, path, expected: str) -> None:
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert rc == 2, captured.err
    assert len(err) == 1 and err[0].startswith("taso-jax: error:"), err
    assert str(path) in err[0] and expected in err[0], err[0]
    assert err[0].count(str(path)) == 1, err[0]  # named once, not once per layer
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_refuses_a_malformed_rule_file_in_one_line(tmp_path, capsys, case):
    path = _write(tmp_path, case)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    out = tmp_path / "proved.json"
    rc = main(["verify", str(path), "-q", "--workers", "1", "-o", str(out)])
    _one_line_exit_2(capsys, rc, path, CASES[case][1])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("case", ["deep_document", "node_refers_to_itself",
                                  "node_refers_to_a_later_node", "size_1e400",
                                  "version_of_5000_digits", "attribute_object", "wrong_arity"])
def test_optimize_refuses_a_malformed_rule_file_in_one_line(tmp_path, capsys, case):
    path = _write(tmp_path, case)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    out = tmp_path / "out.onnx"
    rc = main(["optimize", "--cost-model", "analytic", "--budget", "3", "-q", "--no-time",
               "--substitutions", str(path), "-o", str(out)])
    _one_line_exit_2(capsys, rc, path, CASES[case][1])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_the_shipped_rules_pass_the_checks_and_a_malformed_one_is_a_value_error(tmp_path):
    assert len(default_substitutions()) > 100
    path = _write(tmp_path, "node_refers_to_itself")
    with pytest.raises(ValueError, match="substitution 0 .*source node #0"):
        load_substitutions(path)
    assert issubclass(RuleFileError, ValueError)


@pytest.mark.parametrize("flag", ["-o", "--json"])
def test_optimize_never_writes_over_its_rule_file(tmp_path, capsys, flag):
    from taso_jax.search.rules import save_substitutions

    rules = tmp_path / "rules.json"
    save_substitutions(default_substitutions()[:5], rules)
    link = tmp_path / "link.json"
    link.symlink_to(rules)
    before = hashlib.sha256(rules.read_bytes()).hexdigest()
    for named in (rules, link):
        rc = main(["optimize", "--cost-model", "analytic", "--budget", "3", "-q", "--no-time",
                   "--substitutions", str(rules), flag, str(named)])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1, err
        assert "the --substitutions rule file" in err[0] and flag in err[0], err[0]
        assert hashlib.sha256(rules.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "rules.json"]


@pytest.mark.parametrize("value", ["inf", "nan", "1e400"])
def test_optimize_refuses_an_alpha_that_is_not_finite(capsys, value):
    rc = main(["optimize", "--cost-model", "analytic", "--budget", "3", "-q", "--no-time",
               "--alpha", value])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--alpha must be a finite number >= 1" in err[0], err


@pytest.mark.parametrize("case", ["empty_file", "not_utf8", "top_level_list", "deep_document",
                                  "wrong_arity"])
@pytest.mark.parametrize("door", ["load_substitutions", "search_graph", "decorator"])
def test_the_python_api_names_a_malformed_rule_file_as_the_command_line_does(tmp_path,
                                                                             case, door):
    # json's own error ("Expecting value: line 1 column 1") says where in the text, not
    # which file: each front door raises the RuleFileError that names it (the error the
    # command line reports with exit code 2), the decorator included (not a fallback)
    import warnings

    import jax.numpy as jnp

    import taso_jax

    path = _write(tmp_path, case)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to jax.jit
        with pytest.raises(RuleFileError) as raised:
            if door == "load_substitutions":
                load_substitutions(path)
            elif door == "search_graph":
                b = taso_jax.new_graph()
                b.relu(b.new_input(dims=(2, 3)))
                taso_jax.search_graph(b, substitutions=str(path), cost_model="analytic")
            else:
                taso_jax.optimize(lambda x: jnp.tanh(x) + 1, substitutions=str(path),
                                  cost_model="analytic")(jnp.ones(3))
    message = str(raised.value)
    assert message.startswith(f"{path}: not a valid substitution file ("), message
    assert CASES[case][1] in message and message.count(str(path)) == 1, message
