#!/usr/bin/env python3
"""Regenerates crates/text/tests/fixtures/ (HF reference outputs for deltaserve-text).

Needs a venv outside the repo:
    python3 -m venv /tmp/textenv
    /tmp/textenv/bin/pip install "transformers==5.17.0" tokenizers jinja2
    /tmp/textenv/bin/python scripts/text_fixtures.py

Steps: builds the synthetic tokenizer dir with the Rust example `write_synth_tokenizer`
(copied to fixtures/synth_1024/), then records, with transformers' `apply_chat_template(...,
tokenize=False)` and the `tokenizers` library, the rendered text and ids of a set of
conversations, a set of small templates exercising the Jinja environment, and the ids and
decodes of raw strings. Output: fixtures/text_fixtures.json.
"""
import json
import os
import shutil
import subprocess
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "crates", "text", "tests", "fixtures")
MERGEABLE = 1024
SYNTH_DIR = os.path.join(FIXTURES, f"synth_{MERGEABLE}")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city (uses \"quotes\" & <tags>)",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich or 北京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": "number"}},
            "required": ["query"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def conv(name, messages, tools=None, add_generation_prompt=True, **kwargs):
    return {"name": name, "messages": messages, "tools": tools,
            "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}


CONVERSATIONS = [
    conv("single_user", [{"role": "user", "content": "Hello!"}]),
    conv("system_user", [SYSTEM, {"role": "user", "content": "What is 2+2?"}]),
    conv("no_generation_prompt", [SYSTEM, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello, how can I help?"}],
         add_generation_prompt=False),
    conv("thinking_disabled", [{"role": "user", "content": "Quick answer please."}], enable_thinking=False),
    conv("thinking_enabled_explicit", [{"role": "user", "content": "Think hard."}], enable_thinking=True),
    conv("reasoning_after_last_query", [
        SYSTEM,
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "old reasoning"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "Second answer", "reasoning_content": "\nnew reasoning\n"},
    ], add_generation_prompt=False),
    conv("think_tags_in_content", [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\ninline reasoning\n</think>\n\nvisible answer"},
        {"role": "user", "content": "q2"},
    ]),
    conv("preserve_thinking", [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ], preserve_thinking=True),
    conv("tools_no_system", [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL]),
    conv("tools_with_system", [SYSTEM, {"role": "user", "content": "Find docs"}],
         tools=[WEATHER_TOOL, SEARCH_TOOL]),
    conv("tool_calls_and_results", [
        SYSTEM,
        {"role": "user", "content": "Weather in Zürich and 北京, then search."},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need two calls.",
         "tool_calls": [
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Zürich", "unit": "celsius", "days": 3}}},
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}},
         ]},
        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
        {"role": "tool", "content": "晴天 ☀️ 25°C"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "search", "arguments": {
             "query": "say \"hi\" <b>bold</b> & 'quotes'\nnew line",
             "filters": {"lang": ["en", "zh"], "nested": {"a": 1, "b": [True, None, 2.5]}, "emoji": "🚀"},
             "limit": 10, "exact": False, "score": 1e-05, "none": None}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "result one"}]},
        {"role": "assistant", "content": "All done."},
        {"role": "user", "content": "Thanks"},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    conv("multi_step_tool_pending", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "cold"},
    ], tools=[WEATHER_TOOL]),
    conv("content_parts", [
        {"role": "system", "content": [{"type": "text", "text": "System as parts."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Answer in parts."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
    ]),
    conv("unicode_and_whitespace", [
        {"role": "user", "content": "  Ünïcödé 你好 😀 e\u0301 tabs\tand\r\nCRLF  "},
        {"role": "assistant", "content": "\n\nSpaced answer\n\n"},
        {"role": "user", "content": "Again\u00a0with NBSP"},
    ], enable_thinking=False),
    conv("empty_tools_list", [{"role": "user", "content": "hi"}], tools=[]),
]

ERROR_CONVERSATIONS = [
    conv("bad_role", [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]),
    conv("system_not_first", [{"role": "user", "content": "hi"}, SYSTEM]),
    conv("no_user_query", [SYSTEM]),
]

# Small templates exercising environment features (rendered through apply_chat_template).
ENV_CASES = [
    ("tojson_default", "{{ messages[0] | tojson }}"),
    ("tojson_indent", "{{ messages[0] | tojson(indent=2) }}|{{ tools | tojson(indent=4, sort_keys=true) }}"),
    ("tojson_separators", "{{ tools | tojson(separators=(',', ':')) }}"),
    ("tojson_ascii", "{{ messages | tojson(ensure_ascii=true) }}"),
    ("reverse_slice", "{% for m in messages[::-1] %}{{ loop.index0 }}={{ m.role }};{% endfor %}"),
    ("pycompat_strings",
     "{% set s = messages[0].content %}{{ s.startswith('He') }} {{ s.endswith('!') }} "
     "{{ s.split(' ') | tojson }} [{{ '  x  '.strip() }}] [{{ 'xxaxx'.rstrip('x') }}] [{{ '\\n\\na'.lstrip('\\n') }}] "
     "{{ s.upper() }} {{ s.lower() }} {{ s.replace('l', 'L') }} {{ 'a,b,,c'.split(',') | length }}"),
    ("tests_and_python_values",
     "{{ messages[0] is mapping }} {{ messages is mapping }} {{ messages is iterable }} {{ 'x' is string }} "
     "{{ none }} {{ true }} {{ false }} {{ 1.0 }} {{ 1e16 }} {{ 2.5 | string }} {{ none | string }} "
     "{{ true | string }} {{ [1, 'a', none] }} {{ {'k': 'v'} }}"),
    ("loop_controls",
     "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index0 > 2 %}{% break %}{% endif %}"
     "{{ m.role }}{% if loop.previtem is defined %}<{{ loop.previtem.role }}{% endif %}"
     "{% if loop.nextitem is defined %}>{{ loop.nextitem.role }}{% endif %},{% endfor %}"),
    ("namespace_and_items",
     "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }} "
     "{% for k, v in tools[0].function.parameters.properties | items %}{{ k }}:{{ v.type }} {% endfor %}"
     "{% for k, v in tools[0].function.items() %}{{ k }} {% endfor %}{{ tools[0].get('missing', 'dflt') }}"),
    ("whitespace_control",
     "{% if true %}\n  A\n{% endif %}\n  {% for i in range(3) %}\n{{ i }}\n{% endfor %}\n{{- ' B ' -}}\n  C  \n"),
    ("special_tokens_vars", "[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}]{{ add_generation_prompt }} {{ tools is none }}"),
]
ENV_MESSAGES = [
    {"role": "user", "content": "Hello \"world\" <&> 'q' ünï 😀!"},
    {"role": "assistant", "content": "Hi"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]

RAW_STRINGS = [
    "Hello world",
    "I'm sure they'll say it's fine, DON'T you think? We've I'd you're",
    "Numbers: 12345 3.14159 1,000,000 2024-01-01 0x1F",
    "Line one\r\nLine two\n\n\nLine three\r",
    "你好，世界！大语言模型",
    "日本語とカタカナ、한국어",
    "Emoji 😀🎉🚀 ❤️ 👩‍💻 🇺🇸",
    "Combining: e\u0301 a\u0303 x\u0323\u0302 q\u0303",
    "नमस्ते दुनिया",
    "Non\u00a0breaking\u3000ideographic space",
    "def f(x):\n    return {\"a\": [1, 2], 'b': None}  # comment\n",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "Mixed: café naïve Ångström Straße Việt Nam",
    "\t\ttabs\tand  double  spaces",
    "",
]


def main():
    os.makedirs(FIXTURES, exist_ok=True)
    if os.path.isdir(SYNTH_DIR):
        shutil.rmtree(SYNTH_DIR)
    subprocess.run(["cargo", "run", "-q", "-p", "deltaserve-text", "--example", "write_synth_tokenizer",
                    "--", SYNTH_DIR, str(MERGEABLE)], cwd=ROOT, check=True)
    hf = AutoTokenizer.from_pretrained(SYNTH_DIR)
    raw = Tokenizer.from_file(os.path.join(SYNTH_DIR, "tokenizer.json"))

    def ids_of(text):
        ids = raw.encode(text, add_special_tokens=False).ids
        hf_ids = hf(text, add_special_tokens=False)["input_ids"]
        return ids, hf_ids

    out = {"mergeable": MERGEABLE, "transformers": __import__("transformers").__version__,
           "conversations": [], "errors": [], "env_cases": [], "strings": []}
    for c in CONVERSATIONS:
        text = hf.apply_chat_template(c["messages"], tools=c["tools"], add_generation_prompt=c["add_generation_prompt"],
                                      tokenize=False, **c["kwargs"])
        ids, hf_ids = ids_of(text)
        out["conversations"].append({**c, "text": text, "ids": ids, "hf_ids": hf_ids})
    for c in ERROR_CONVERSATIONS:
        try:
            hf.apply_chat_template(c["messages"], tools=c["tools"], add_generation_prompt=c["add_generation_prompt"],
                                   tokenize=False, **c["kwargs"])
            sys.exit(f"error case {c['name']} rendered without error")
        except Exception as e:  # jinja2 TemplateError from raise_exception
            out["errors"].append({**c, "message": str(e)})
    for name, template in ENV_CASES:
        text = hf.apply_chat_template(ENV_MESSAGES, tools=[WEATHER_TOOL], chat_template=template,
                                      add_generation_prompt=True, tokenize=False)
        out["env_cases"].append({"name": name, "template": template, "messages": ENV_MESSAGES,
                                 "tools": [WEATHER_TOOL], "add_generation_prompt": True, "text": text})
    for s in RAW_STRINGS:
        ids, hf_ids = ids_of(s)
        out["strings"].append({"text": s, "ids": ids, "hf_ids": hf_ids,
                               "tokens": raw.encode(s, add_special_tokens=False).tokens,
                               "decoded": raw.decode(ids, skip_special_tokens=False),
                               "decoded_skip_special": raw.decode(ids, skip_special_tokens=True),
                               "hf_decoded_skip_special": hf.decode(hf_ids, skip_special_tokens=True)})
    path = os.path.join(FIXTURES, "text_fixtures.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    diverged = [s["text"] for s in out["strings"] if s["ids"] != s["hf_ids"]]
    diverged += [c["name"] for c in out["conversations"] if c["ids"] != c["hf_ids"]]
    print(f"wrote {path}; AutoTokenizer ids differ from tokenizer.json ids for: {diverged}")


if __name__ == "__main__":
    main()
