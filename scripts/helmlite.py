#!/usr/bin/env python3
"""Render kvxferd's Helm chart without helm: a strict subset of Go templates.

helm cannot be installed on the build machines (no release on PyPI, Debian
or npm), so the tests render ``deploy/helm/kvxferd`` with this file and
validate every object against the Kubernetes schemas. It knows exactly
what the chart uses and raises on anything else, so a template construct
it does not understand fails the test instead of rendering wrongly:

* actions ``{{ pipeline }}`` with ``{{-`` / ``-}}`` whitespace trimming;
* ``if`` / ``else`` / ``end``, ``range $v := pipeline``, ``define`` and
  ``include``, comments ``{{/* */}}``;
* operands: ``.Values.a.b``, ``.Release.Name``, ``$``, ``$v.a``, ``.`` and
  fields of it, strings, integers, parenthesised pipelines;
* functions: include, toYaml, nindent, indent, quote, default, printf
  (``%s``/``%d``/``%v``), add, int, until, list, dict, eq, ne, not, trunc,
  trimSuffix.

    python scripts/helmlite.py deploy/helm/kvxferd [-f values.yaml] [--set a.b=v]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import yaml

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<int>-?\d+)|(?P<var>\$[A-Za-z_]\w*|\$)(?P<varpath>(?:\.\w+)*)'
                   r"|(?P<field>(?:\.\w+)+|\.)|(?P<assign>:=)|(?P<lp>\()|(?P<rp>\))|(?P<pipe>\|)|(?P<ident>[A-Za-z_]\w*))")


_KINDS = ("str", "int", "var", "field", "assign", "lp", "rp", "pipe", "ident")


def _kind(token: re.Match) -> str:
    return next(name for name in _KINDS if token.group(name) is not None)


class TemplateError(ValueError):
    """A construct this renderer does not support, or a bad template."""


def _to_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=False).rstrip("\n") if value not in (None, {}, []) else (
        "{}" if value == {} else "[]" if value == [] else "null")


def _printf(fmt: str, *args) -> str:
    return re.sub(r"%[sdv]", lambda _m, it=iter(args): str(next(it)), fmt)


FUNCTIONS = {
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + "\n".join(" " * n + line if line else line for line in str(s).split("\n")),
    "indent": lambda n, s: "\n".join(" " * n + line if line else line for line in str(s).split("\n")),
    "quote": lambda s: '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"',
    "default": lambda fallback, value=None: value if value not in (None, "", 0, False, [], {}) else fallback,
    "printf": _printf,
    "add": lambda *xs: sum(int(x) for x in xs),
    "int": int,
    "until": lambda n: list(range(int(n))),
    "list": lambda *xs: list(xs),
    "dict": lambda *kv: dict(zip(kv[::2], kv[1::2])),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "not": lambda a: not a,
    "trunc": lambda n, s: str(s)[:n],
    "trimSuffix": lambda suffix, s: str(s)[: -len(suffix)] if suffix and str(s).endswith(suffix) else str(s),
}


def _lookup(value, path: str):
    for name in filter(None, path.split(".")):
        if not isinstance(value, dict):
            raise TemplateError(f"cannot take .{name} of {type(value).__name__}")
        value = value.get(name)
    return value


class Renderer:
    def __init__(self, defines: dict[str, list]) -> None:
        self.defines = defines

    # ---- expressions ----------------------------------------------------
    def pipeline(self, text: str, dot, scope: dict):
        tokens = [m for m in TOKEN.finditer(text)]
        if "".join(m.group(0) for m in tokens).strip() != text.strip():
            raise TemplateError(f"cannot parse {{{{ {text} }}}}")
        value, rest = self._pipeline(tokens, dot, scope)
        if rest:
            raise TemplateError(f"unexpected {rest[0].group(0)!r} in {{{{ {text} }}}}")
        return value

    def _pipeline(self, tokens, dot, scope):
        value, tokens = self._command(tokens, dot, scope, None, False)
        while tokens and _kind(tokens[0]) == "pipe":
            value, tokens = self._command(tokens[1:], dot, scope, value, True)
        return value, tokens

    def _command(self, tokens, dot, scope, piped, has_piped):
        if not tokens:
            raise TemplateError("empty command")
        if _kind(tokens[0]) == "ident":
            name = tokens[0].group("ident")
            args, tokens = self._operands(tokens[1:], dot, scope)
            if has_piped:
                args.append(piped)
            return self.call(name, args, dot, scope), tokens
        if has_piped:
            raise TemplateError("a value piped into a non-function")
        args, tokens = self._operands(tokens, dot, scope)
        if len(args) != 1:
            raise TemplateError("several operands without a function")
        return args[0], tokens

    def _operands(self, tokens, dot, scope):
        args = []
        while tokens and _kind(tokens[0]) not in ("pipe", "rp"):
            token, tokens = tokens[0], tokens[1:]
            kind = _kind(token)
            if kind == "str":
                args.append(yaml.safe_load(token.group("str")))
            elif kind == "int":
                args.append(int(token.group("int")))
            elif kind == "var":
                name = token.group("var")
                if name not in scope:
                    raise TemplateError(f"undefined variable {name}")
                args.append(_lookup(scope[name], token.group("varpath")))
            elif kind == "field":
                args.append(_lookup(dot, token.group("field")))
            elif kind == "lp":
                value, tokens = self._pipeline(tokens, dot, scope)
                if not tokens or _kind(tokens[0]) != "rp":
                    raise TemplateError("missing )")
                args.append(value)
                tokens = tokens[1:]
            else:
                raise TemplateError(f"unexpected {token.group(0).strip()!r}")
        return args, tokens

    def call(self, name, args, dot, scope):
        if name == "include":
            template, context = args
            if template not in self.defines:
                raise TemplateError(f"no template {template!r} defined")
            return self.render_nodes(self.defines[template], context, {"$": context})
        if name not in FUNCTIONS:
            raise TemplateError(f"function {name!r} is not supported by helmlite")
        return FUNCTIONS[name](*args)

    # ---- statements -----------------------------------------------------
    def render_nodes(self, nodes, dot, scope) -> str:
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "expr":
                value = self.pipeline(node[1], dot, scope)
                out.append("" if value is None else str(value).lower() if isinstance(value, bool) else str(value))
            elif kind == "if":
                branch = node[2] if _truthy(self.pipeline(node[1], dot, scope)) else node[3]
                out.append(self.render_nodes(branch, dot, scope))
            elif kind == "range":
                variable, expr, body = node[1], node[2], node[3]
                for item in self.pipeline(expr, dot, scope) or []:
                    out.append(self.render_nodes(body, item, {**scope, variable: item}))
        return "".join(out)


def _truthy(value) -> bool:
    return value not in (None, False, 0, "", [], {})


def parse(source: str, defines: dict[str, list]) -> list:
    """Template text -> nodes; ``define`` blocks go into ``defines``."""
    pieces, position = [], 0
    for match in ACTION.finditer(source):
        text = source[position : match.start()]
        if match.group(1):
            text = text.rstrip(" \t\n")
        if pieces and pieces[-1][0] == "trim_next":
            pieces.pop()
            text = text.lstrip(" \t\n")
        pieces.append(("text", text))
        pieces.append(("action", match.group(2)))
        if match.group(3):
            pieces.append(("trim_next",))
        position = match.end()
    tail = source[position:]
    if pieces and pieces[-1][0] == "trim_next":
        pieces.pop()
        tail = tail.lstrip(" \t\n")
    pieces.append(("text", tail))
    nodes, rest = _block(pieces, defines, top=True)
    return nodes


def _block(pieces, defines, top=False):
    nodes = []
    while pieces:
        piece, pieces = pieces[0], pieces[1:]
        if piece[0] == "text":
            nodes.append(piece)
            continue
        action = piece[1]
        if action.startswith("/*"):
            continue
        word = action.split(None, 1)[0] if action else ""
        if word in ("end", "else"):
            if top:
                raise TemplateError(f"unexpected {{{{ {word} }}}}")
            return nodes, [piece, *pieces]
        if word == "if":
            then, pieces = _block(pieces, defines)
            otherwise = []
            if pieces[0][1] == "else":
                otherwise, pieces = _block(pieces[1:], defines)
            nodes.append(("if", action[2:].strip(), then, otherwise))
            pieces = _expect_end(pieces)
        elif word == "range":
            match = re.fullmatch(r"range\s+(\$\w+)\s*:=\s*(.+)", action, re.S)
            if not match:
                raise TemplateError(f"range needs '$v := pipeline': {action}")
            body, pieces = _block(pieces, defines)
            nodes.append(("range", match.group(1), match.group(2), body))
            pieces = _expect_end(pieces)
        elif word == "define":
            name = yaml.safe_load(action[len("define"):].strip())
            body, pieces = _block(pieces, defines)
            defines[name] = body
            pieces = _expect_end(pieces)
        elif word in ("with", "template", "block", "tpl", "required", "fail"):
            raise TemplateError(f"{{{{ {word} }}}} is not supported by helmlite")
        else:
            nodes.append(("expr", action))
    if not top:
        raise TemplateError("missing {{ end }}")
    return nodes, []


def _expect_end(pieces):
    if not pieces or pieces[0][1] != "end":
        raise TemplateError("missing {{ end }}")
    return pieces[1:]


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _set(values: dict, assignment: str) -> dict:
    path, _, raw = assignment.partition("=")
    override = node = {}
    *parents, leaf = path.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = yaml.safe_load(raw)
    return _merge(values, override)


def render_chart(chart_dir, values: dict | None = None, sets=(), release: str = "kvxferd",
                 namespace: str = "default") -> dict[str, str]:
    """``{template file: rendered text}`` for every template of the chart (helpers excluded)."""
    chart_dir = pathlib.Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    merged = _merge(yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}, values or {})
    for assignment in sets:
        merged = _set(merged, assignment)
    root = {"Values": merged, "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
            "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart.get("appVersion")}}
    defines: dict[str, list] = {}
    templates = sorted((chart_dir / "templates").glob("*"))
    parsed = {path.name: parse(path.read_text(), defines) for path in templates}
    renderer = Renderer(defines)
    return {name: renderer.render_nodes(nodes, root, {"$": root}) for name, nodes in parsed.items()
            if not name.startswith("_") and name.endswith((".yaml", ".yml"))}


def render_objects(chart_dir, **kwargs) -> list[dict]:
    """Every Kubernetes object the chart renders, parsed."""
    objects = []
    for text in render_chart(chart_dir, **kwargs).values():
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def render_stream(chart_dir, values: dict | None = None, sets=()) -> str:
    """One multi-document YAML stream, like ``helm template``."""
    rendered = render_chart(chart_dir, values, sets)
    return "".join(f"---\n# Source: {name}\n{text.strip()}\n" for name, text in rendered.items() if text.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chart")
    parser.add_argument("-f", "--values", help="a values file merged over the chart's")
    parser.add_argument("--set", action="append", default=[], help="a.b=value (YAML value)")
    args = parser.parse_args(argv)
    values = yaml.safe_load(pathlib.Path(args.values).read_text()) if args.values else None
    sys.stdout.write(f"# Rendered by scripts/helmlite.py from {args.chart}" + (f" with {args.values}" if args.values else "")
                     + "".join(f" --set {a}" for a in args.set) + "; edit the chart, not this file.\n"
                     + render_stream(args.chart, values, args.set))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
