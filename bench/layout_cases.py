"""Tool-calling cases for bench/layout_quality.py: coding-agent tools, agent system prompts, user requests.

A case is a few tools (OpenAI function schemas, `additionalProperties: false` as Claude Code's are), a
system prompt with per-instance text (working directory, date, git hash), and a user request that one of
the tools answers. Cases come in agents: an agent is one tool set and one system prompt, and gets a few
requests, each for one of its tools (so its cases share the whole system turn, and the prefix cache computes
it once per layout). `make_cases(n, seed)` draws them deterministically: the same seed gives the same cases
on every machine (only `random.Random` and sorted pools, no hash order).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_STR = {"type": "string"}
TOOLS: dict[str, dict[str, Any]] = {
    t["function"]["name"]: t
    for t in [
        _function(
            "read_file",
            "Reads a file from the local filesystem and returns its text with line numbers.",
            {
                "path": {**_STR, "description": "Absolute or workspace-relative path of the file"},
                "offset": {"type": "integer", "minimum": 1, "description": "First line to read"},
                "limit": {"type": "integer", "minimum": 1, "description": "How many lines to read"},
            },
            ["path"],
        ),
        _function(
            "write_file",
            "Writes text to a file, creating it or overwriting what it holds.",
            {
                "path": {**_STR, "description": "Path of the file"},
                "content": {**_STR, "description": "New text"},
            },
            ["path", "content"],
        ),
        _function(
            "edit_file",
            "Replaces one exact occurrence of a string in a file with another string.",
            {
                "path": {**_STR, "description": "Path of the file"},
                "old_string": {**_STR, "description": "The text to replace, exactly as in the file"},
                "new_string": {**_STR, "description": "The replacement text"},
            },
            ["path", "old_string", "new_string"],
        ),
        _function(
            "run_shell",
            "Runs a bash command in the working directory and returns its output and exit code.",
            {
                "command": {**_STR, "description": "The command line to run"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600, "description": "Time limit"},
            },
            ["command"],
        ),
        _function(
            "search",
            "Searches file contents for a regular expression and returns the matching lines.",
            {
                "pattern": {**_STR, "description": "Regular expression to look for"},
                "path": {**_STR, "description": "Folder to search in (default: the working directory)"},
                "case_sensitive": {"type": "boolean"},
            },
            ["pattern"],
        ),
        _function(
            "list_dir",
            "Lists the files and folders in a directory.",
            {
                "path": {**_STR, "description": "The directory to list"},
                "recursive": {"type": "boolean", "description": "Also list subdirectories"},
            },
            ["path"],
        ),
        _function(
            "get_weather",
            "Gets the current weather in a city.",
            {
                "city": {**_STR, "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            ["city"],
        ),
        _function(
            "web_fetch",
            "Fetches a web page and returns its text as markdown.",
            {"url": {**_STR, "description": "The http or https URL to fetch"}},
            ["url"],
        ),
        _function(
            "git_commit",
            "Commits the staged changes with a message.",
            {
                "message": {**_STR, "description": "The commit message"},
                "all": {"type": "boolean", "description": "Stage every modified file first"},
            },
            ["message"],
        ),
        _function(
            "delete_file",
            "Deletes a file from the workspace.",
            {"path": {**_STR, "description": "Path of the file to delete"}},
            ["path"],
        ),
        _function(
            "create_issue",
            "Opens an issue in the project's tracker.",
            {
                "title": {**_STR, "description": "One-line summary"},
                "body": {**_STR, "description": "Details, in markdown"},
                "labels": {"type": "array", "items": _STR},
            },
            ["title"],
        ),
        _function(
            "run_tests",
            "Runs the test suite, or the tests in one file or folder, and reports failures.",
            {
                "target": {**_STR, "description": "Test file or folder"},
                "verbose": {"type": "boolean"},
            },
            ["target"],
        ),
        _function(
            "calculator",
            "Evaluates an arithmetic expression.",
            {"expression": {**_STR, "description": "For example 2 * (3 + 4)"}},
            ["expression"],
        ),
        _function(
            "send_message",
            "Posts a message to a team chat channel.",
            {"channel": {**_STR, "description": "Channel name, e.g. #dev"}, "text": _STR},
            ["channel", "text"],
        ),
    ]
}

_FILES = [
    "src/main.py",
    "src/server/app.py",
    "README.md",
    "pyproject.toml",
    "tests/test_parser.py",
    "lib/utils.js",
    "docs/setup.md",
    "Makefile",
    "config/settings.yaml",
    "cmd/api/main.go",
    "src/lib.rs",
    "package.json",
]
_DIRS = ["src", "tests", "docs", "lib", "scripts", "src/server", "config", "."]
_CITIES = ["Paris", "Tokyo", "Berlin", "Lagos", "Lima", "Toronto", "Mumbai", "Oslo", "Sydney", "Cairo"]
_COMMANDS = ["ls -la", "git status", "npm install", "make build", "python --version", "df -h", "cargo check"]
_PATTERNS = ["TODO", "def main", "import requests", "fixme", "class Config", "useEffect", "panic!"]
_URLS = [
    "https://docs.python.org/3/library/json.html",
    "https://example.com/changelog",
    "https://go.dev/doc/",
]
_MESSAGES = ["Fix the off-by-one in the pager", "Add a retry to the HTTP client", "Update the README"]
_TITLES = ["Crash when the config file is empty", "Tests fail on Windows", "Slow startup with many plugins"]
_EXPRESSIONS = ["17 * 23", "(1024 - 37) / 3", "2 ** 16", "3.5 * 12 + 4"]
_CHANNELS = ["#dev", "#release", "#ops"]
_WORDS = ["timeout", "retries", "verbose", "port", "debug", "name"]

# Per tool: requests as a user of a coding agent writes them, each with the arguments of a right call; {file},
# {dir}, ... are drawn from the lists above. The arguments serve an agent's earlier turn, its example call.
REQUESTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "read_file": [
        ("Show me what's in {file}.", {"path": "{file}"}),
        ("Open {file} and read it.", {"path": "{file}"}),
        ("Read lines 10 to 40 of {file}.", {"path": "{file}", "offset": 10, "limit": 31}),
    ],
    "write_file": [
        (
            "Create {file} containing a short hello-world program.",
            {"path": "{file}", "content": "print('hello')"},
        ),
        ("Overwrite {file} with the text '{word} = 1'.", {"path": "{file}", "content": "{word} = 1"}),
    ],
    "edit_file": [
        (
            "In {file}, replace '{word} = 1' with '{word} = 2'.",
            {"path": "{file}", "old_string": "{word} = 1", "new_string": "{word} = 2"},
        ),
        (
            "Rename the variable {word} to {word}_s in {file}.",
            {"path": "{file}", "old_string": "{word}", "new_string": "{word}_s"},
        ),
    ],
    "run_shell": [
        ("Run `{command}` and tell me the output.", {"command": "{command}"}),
        ("Execute {command} in the shell.", {"command": "{command}"}),
    ],
    "search": [
        ("Find every place where '{pattern}' appears in the code.", {"pattern": "{pattern}"}),
        ("Search the {dir} folder for {pattern}.", {"pattern": "{pattern}", "path": "{dir}"}),
    ],
    "list_dir": [
        ("What files are in the {dir} folder?", {"path": "{dir}"}),
        ("List everything under {dir}, subfolders too.", {"path": "{dir}", "recursive": True}),
    ],
    "get_weather": [
        ("What's the weather like in {city} right now?", {"city": "{city}"}),
        ("How warm is it in {city}, in celsius?", {"city": "{city}", "unit": "celsius"}),
    ],
    "web_fetch": [
        ("Fetch {url} and summarise it.", {"url": "{url}"}),
        ("What does the page at {url} say?", {"url": "{url}"}),
    ],
    "git_commit": [
        ("Commit my changes with the message '{message}'.", {"message": "{message}"}),
        ("Stage everything and commit: {message}.", {"message": "{message}", "all": True}),
    ],
    "delete_file": [
        ("Delete {file}, it is not needed any more.", {"path": "{file}"}),
        ("Remove the file {file}.", {"path": "{file}"}),
    ],
    "create_issue": [
        ("Open an issue titled '{title}'.", {"title": "{title}"}),
        ("File a bug report: {title}. Label it bug.", {"title": "{title}", "labels": ["bug"]}),
    ],
    "run_tests": [
        ("Run the tests in {dir}.", {"target": "{dir}"}),
        (
            "Run tests/test_parser.py verbosely and show the failures.",
            {"target": "tests/test_parser.py", "verbose": True},
        ),
    ],
    "calculator": [
        ("What is {expression}?", {"expression": "{expression}"}),
        ("Compute {expression} for me.", {"expression": "{expression}"}),
    ],
    "send_message": [
        (
            "Tell the team in {channel} that the build is green.",
            {"channel": "{channel}", "text": "The build is green."},
        ),
        ("Post 'deploying now' to {channel}.", {"channel": "{channel}", "text": "deploying now"}),
    ],
}

# Per tool: what an earlier call of it returned, and the agent's answer after it.
RESULTS: dict[str, tuple[str, str]] = {
    "read_file": (
        "1  # settings\n2  timeout = 30\n3  retries = 3",
        "The file sets a timeout of 30 and 3 retries.",
    ),
    "write_file": ("Wrote 1 file.", "Done: the file is written."),
    "edit_file": ("Replaced 1 occurrence.", "Done: the edit is made."),
    "run_shell": ("exit code 0\nok", "The command succeeded and printed ok."),
    "search": (
        "src/main.py:12: match\nlib/utils.js:40: match",
        "There are two matches, in src/main.py and lib/utils.js.",
    ),
    "list_dir": ("main.py\nutils.py\n__init__.py", "It holds main.py, utils.py and __init__.py."),
    "get_weather": ('{"temperature": 18, "conditions": "cloudy"}', "It is 18 degrees and cloudy."),
    "web_fetch": (
        "# Release notes\nVersion 2.1 fixes three bugs.",
        "The page says version 2.1 fixes three bugs.",
    ),
    "git_commit": ("[main 4f2a1c9] committed", "Committed as 4f2a1c9."),
    "delete_file": ("Deleted.", "The file is deleted."),
    "create_issue": ('{"number": 42}', "Opened issue #42."),
    "run_tests": ("12 passed, 1 failed: test_empty_input", "12 tests pass; test_empty_input fails."),
    "calculator": ("391", "The result is 391."),
    "send_message": ("sent", "The message is posted."),
}

_AGENTS = ["Qwen Code", "an interactive CLI coding agent", "Claude Code", "a software engineering assistant"]
_RULES = [
    "Be concise: answer in a few lines unless the user asks for detail.",
    "Never guess file contents; read a file before you edit it.",
    "Use the tools to act, rather than describing what you would do.",
    "Follow the conventions of the existing code: its style, its libraries, its tests.",
    "Do not commit changes unless the user asks you to.",
    "Prefer small, reviewable edits over large rewrites.",
    "When a command may change the system, say what it does first.",
    "Paths in tool calls are relative to the working directory unless absolute.",
]
_USERS = ["ann", "bo", "chen", "dev", "maria", "sam"]
_PROJECTS = ["webshop", "parser", "infra", "mobile-app", "ml-pipeline", "blog"]
_BRANCHES = ["main", "fix/pager", "feature/retry", "dev"]


@dataclass(frozen=True)
class Case:
    """One tool-calling case: the tools offered, the system text, the user request, and the tool to call."""

    tools: list[dict[str, Any]]
    system: str
    user: str
    expected: str  # the name of the tool that answers the request
    agent: int  # cases of one agent share the tools, the system text and the earlier turn
    earlier: list[dict[str, Any]] = field(default_factory=list)  # an exchange before the request, if any

    def messages(self) -> list[dict[str, Any]]:
        """The chat: the system text, the earlier turn, then the user request."""
        system = {"role": "system", "content": self.system}
        return [system, *self.earlier, {"role": "user", "content": self.user}]

    def schema(self) -> dict[str, Any]:
        """The expected tool's parameters schema."""
        schema: dict[str, Any] = TOOLS[self.expected]["function"]["parameters"]
        return schema


def _system(rng: random.Random) -> str:
    user, project = rng.choice(_USERS), rng.choice(_PROJECTS)
    rules = rng.sample(_RULES, rng.randint(2, 5))
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    git = f"{rng.choice(_BRANCHES)} at {rng.getrandbits(28):07x}"
    return (
        f"You are {rng.choice(_AGENTS)}, helping a user with software engineering tasks.\n\n"
        + "\n".join(f"- {rule}" for rule in rules)
        + f"\n\n# Environment\nWorking directory: /home/{user}/{project}\nPlatform: linux\n"
        f"Today's date: {date}\nGit: {git}"
    )


def _fills(rng: random.Random) -> dict[str, str]:
    return {
        "file": rng.choice(_FILES),
        "dir": rng.choice(_DIRS),
        "city": rng.choice(_CITIES),
        "command": rng.choice(_COMMANDS),
        "pattern": rng.choice(_PATTERNS),
        "url": rng.choice(_URLS),
        "message": rng.choice(_MESSAGES),
        "title": rng.choice(_TITLES),
        "expression": rng.choice(_EXPRESSIONS),
        "channel": rng.choice(_CHANNELS),
        "word": rng.choice(_WORDS),
    }


def _request(rng: random.Random, tool: str) -> tuple[str, dict[str, Any]]:
    """A request for `tool` and the arguments of a right call."""
    text, arguments = rng.choice(REQUESTS[tool])
    fills = _fills(rng)
    return text.format(**fills), {
        k: v.format(**fills) if isinstance(v, str) else v for k, v in arguments.items()
    }


def _earlier_turn(rng: random.Random, tool: str) -> list[dict[str, Any]]:
    """An exchange the agent already had: a request, its call of `tool`, the result, the answer."""
    text, arguments = _request(rng, tool)
    result, answer = RESULTS[tool]
    call = {"type": "function", "function": {"name": tool, "arguments": arguments}}
    return [
        {"role": "user", "content": text},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]


def make_agent_cases(
    rng: random.Random,
    agent: int,
    num_requests: int,
    earlier_turn: bool = False,
    min_tools: int = 3,
    max_tools: int = 5,
) -> list[Case]:
    """One agent's cases: its tools (a random few, in a random order), its system text, optionally an
    earlier exchange with a right call of one of them, and `num_requests` requests, each for one of its tools
    (one the earlier call did not use, so that copying that call is never right)."""
    offered = rng.sample(sorted(TOOLS), rng.randint(min_tools, max_tools))
    tools, system = [TOOLS[n] for n in offered], _system(rng)
    candidates, earlier = offered, []
    if earlier_turn:
        example = rng.choice(offered)
        candidates, earlier = [n for n in offered if n != example], _earlier_turn(rng, example)
    cases = []
    for _ in range(num_requests):
        expected = rng.choice(candidates)
        cases.append(Case(tools, system, _request(rng, expected)[0], expected, agent, earlier))
    return cases


def make_cases(n: int, seed: int = 0, requests_per_agent: int = 8, earlier_turn: bool = True) -> list[Case]:
    """`n` cases drawn from `seed`, `requests_per_agent` to an agent (the last agent may get fewer), each
    agent with an earlier exchange when `earlier_turn`."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < n:
        count = min(requests_per_agent, n - len(cases))
        cases += make_agent_cases(rng, len(cases) // requests_per_agent, count, earlier_turn)
    return cases


def schema_errors(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """Why `value` breaks `schema` (the JSON Schema subset the tools above use); empty when it is valid.

    Covers type, properties, required, additionalProperties false, enum, minimum/maximum and array items;
    integers are not booleans, as in JSON Schema.
    """
    kind = schema.get("type")
    if kind is not None and not _has_type(value, kind):
        return [f"{where}: {type(value).__name__} is not {kind}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected {key!r}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def _has_type(value: Any, kind: str) -> bool:
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: (
            isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
        ),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return checks[kind](value)
