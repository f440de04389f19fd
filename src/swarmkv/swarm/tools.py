"""The tool schemas a coding-agent harness hands its model, in the OpenAI function format."""

from __future__ import annotations

from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _str(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


def _int(description: str) -> dict[str, str]:
    return {"type": "integer", "description": description}


CODING_TOOLS: tuple[dict[str, Any], ...] = (
    _tool(
        "read_file",
        "Read a text file from the workspace. Returns the file's lines prefixed with line numbers. "
        "Use offset and limit to page through large files instead of reading them whole.",
        {
            "path": _str("Path of the file, relative to the workspace root."),
            "offset": _int("First line to return, 1-based. Defaults to 1."),
            "limit": _int("Maximum number of lines to return. Defaults to 400."),
        },
        ["path"],
    ),
    _tool(
        "write_file",
        "Create a file or replace its whole content. Parent directories are created as needed. "
        "Prefer edit_file for changes to existing files so that unrelated lines stay untouched.",
        {
            "path": _str("Path of the file to write."),
            "content": _str("The complete new content of the file."),
        },
        ["path", "content"],
    ),
    _tool(
        "edit_file",
        "Replace one exact occurrence of old_text with new_text in a file. Fails if old_text is absent or "
        "appears more than once; include enough surrounding context to make it unique.",
        {
            "path": _str("Path of the file to edit."),
            "old_text": _str("The exact text to replace, including whitespace."),
            "new_text": _str("The replacement text."),
        },
        ["path", "old_text", "new_text"],
    ),
    _tool(
        "run_command",
        "Run a shell command in the workspace and return its exit code, stdout and stderr. Commands time out "
        "after timeout_s seconds. Do not start servers or interactive programs.",
        {
            "command": _str("The command line, run with bash -lc."),
            "timeout_s": _int("Seconds before the command is killed. Defaults to 120."),
            "cwd": _str("Working directory relative to the workspace root."),
        },
        ["command"],
    ),
    _tool(
        "search_code",
        "Search file contents with a regular expression (ripgrep syntax). Returns matching lines with paths "
        "and line numbers, at most max_results of them.",
        {
            "pattern": _str("Regular expression to search for."),
            "path": _str("Directory or file to search in. Defaults to the workspace root."),
            "glob": _str("Only search files matching this glob, e.g. '*.py'."),
            "max_results": _int("Maximum number of matches to return. Defaults to 100."),
        },
        ["pattern"],
    ),
    _tool(
        "list_directory",
        "List the entries of a directory with their sizes and kinds (file, directory, symlink). "
        "Hidden entries and ignored paths are skipped unless include_hidden is true.",
        {
            "path": _str("Directory to list, relative to the workspace root."),
            "depth": _int("How many levels to descend. Defaults to 1."),
            "include_hidden": {"type": "boolean", "description": "Also list dotfiles and ignored paths."},
        },
        ["path"],
    ),
    _tool(
        "find_files",
        "Find files whose path matches a glob pattern, newest first.",
        {"pattern": _str("Glob pattern such as 'src/**/*.py'."), "limit": _int("Maximum number of paths.")},
        ["pattern"],
    ),
    _tool(
        "git_status",
        "Show the working tree status: the current branch, staged, unstaged and untracked files.",
        {"porcelain": {"type": "boolean", "description": "Machine-readable output."}},
        [],
    ),
    _tool(
        "git_diff",
        "Show changes between the working tree, the index and commits as a unified diff.",
        {
            "staged": {"type": "boolean", "description": "Diff the index against HEAD instead of the tree."},
            "paths": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Limit the diff to these paths.",
            },
            "base": _str("Compare against this commit or branch instead of HEAD."),
        },
        [],
    ),
    _tool(
        "run_tests",
        "Run the project's test suite, or a subset of it, and return a summary with the failures' tracebacks.",
        {
            "selector": _str("Test file, directory or node id to run. Defaults to the whole suite."),
            "keyword": _str("Only run tests whose names match this expression."),
            "fail_fast": {"type": "boolean", "description": "Stop at the first failure."},
        },
        [],
    ),
    _tool(
        "apply_patch",
        "Apply a unified diff to the workspace. All hunks must apply cleanly or nothing is changed.",
        {"patch": _str("The unified diff, with ---/+++ headers and @@ hunks.")},
        ["patch"],
    ),
    _tool(
        "ask_user",
        "Ask the user a question and wait for the answer. Use only when the task is ambiguous and no "
        "reasonable default exists.",
        {
            "question": _str("The question, self-contained."),
            "choices": {"type": "array", "items": {"type": "string"}, "description": "Suggested answers."},
        },
        ["question"],
    ),
)
