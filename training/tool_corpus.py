"""The generated tool-use conversations the embedded tool model is trained on.

Every conversation is an OpenAI-style ``(tools, messages)`` pair, seeded and deterministic:

- a user asks a question one of the request's tools answers; the assistant calls it with the
  arguments copied from the question, the tool answers, the assistant answers in one sentence;
- sometimes no tool applies (or there are no tools) and the assistant answers directly;
- sometimes the question needs two calls, made in parallel in one reply;
- sometimes the user asks for a JSON object and the assistant writes one.

The model learns the format (which tool, which arguments, when to stop), not facts: its
answers only repeat what the question and the tool results said.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CITIES = (
    "Paris", "London", "Berlin", "Tokyo", "New York", "Madrid", "Rome", "Lisbon", "Oslo",
    "Cairo", "Sydney", "Toronto", "Chicago", "Boston", "Seattle", "Vienna", "Prague", "Dublin",
    "Athens", "Warsaw", "Zurich", "Geneva", "Munich", "Milan", "Seoul", "Beijing", "Delhi",
    "Mumbai", "Lagos", "Nairobi", "Lima", "Bogota", "Santiago", "Denver", "Miami", "Austin",
    "Amsterdam", "Brussels", "Helsinki", "Stockholm", "Copenhagen", "Budapest", "Istanbul",
    "Dubai", "Bangkok", "Singapore", "Jakarta", "Manila", "Hanoi", "Osaka", "Kyoto", "Montreal",
    "Vancouver", "Mexico City", "San Francisco", "Los Angeles", "Cape Town", "Buenos Aires",
)
COUNTRIES = (
    "France", "Germany", "Japan", "Spain", "Italy", "Portugal", "Norway", "Egypt", "Australia",
    "Canada", "Brazil", "India", "Kenya", "Peru", "Chile", "Mexico", "Sweden", "Poland",
    "Greece", "Ireland", "Austria", "Finland", "Turkey", "Thailand", "Vietnam", "Korea",
)
WEATHER = (
    "sunny, 24 C", "cloudy, 12 C", "rain, 9 C", "snow, -3 C", "windy, 15 C", "foggy, 7 C",
    "clear, 30 C", "storms, 18 C", "light rain, 11 C", "hot, 35 C", "mild, 19 C", "cold, 2 C",
)
NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
         "Mallory", "Oscar", "Peggy", "Trent", "Victor", "Walter", "Maria", "Chen", "Ahmed")
WORDS = ("report", "budget", "meeting", "invoice", "travel", "launch", "review", "design",
         "lunch", "project", "holiday", "contract", "update", "draft", "release", "party")
FILES = ("README.md", "src/main.py", "config.json", "notes.txt", "setup.py", "data.csv",
         "docs/index.md", "app/server.py", "tests/test_api.py", "Makefile", "report.pdf")
COMMANDS = ("ls -la", "git status", "python -m pytest", "make build", "df -h", "pwd",
            "git log -1", "uname -a", "npm test", "cargo build")
SYMBOLS = ("AAPL", "MSFT", "NVDA", "GOOG", "AMZN", "TSLA", "META", "IBM", "INTC", "ORCL")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Japanese", "Portuguese", "Dutch")
PHRASES = ("good morning", "thank you", "where is the station", "see you tomorrow",
           "how much is it", "I like coffee", "the book is red", "happy birthday")
TOPICS = ("python dataclasses", "the latest news", "how to cook rice", "electric cars",
          "the tallest mountain", "cheap flights", "jazz music", "climate change", "chess openings",
          "the history of Rome", "rust ownership", "healthy breakfast ideas")


def _expr(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"{a} {rng.choice('+-*/')} {b}"


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """A tool of the corpus: its schema pieces, how to ask for it and how to answer."""

    name: str
    description: str
    args: dict[str, tuple[str, ...] | Any]
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    results: tuple[str, ...] = ()
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)


TOOLS = (
    ToolSpec("get_weather", "Current weather of a city.", {"city": CITIES},
             ("What is the weather in {city}?", "What's the weather like in {city}?",
              "How is the weather in {city} today?", "Is it raining in {city}?",
              "Tell me the weather in {city}.", "weather in {city}", "Weather for {city}, please.",
              "Do I need an umbrella in {city}?", "What's the temperature in {city}?"),
             ("The weather in {city} is {result}.", "In {city} it is {result}.",
              "It is {result} in {city} right now."), WEATHER),
    ToolSpec("get_time", "Current local time in a city.", {"city": CITIES},
             ("What time is it in {city}?", "What is the local time in {city}?",
              "Tell me the time in {city}."),
             ("The time in {city} is {result}.", "It is {result} in {city}."),
             ("09:15", "14:30", "22:05", "06:45", "18:00", "11:20")),
    ToolSpec("search_web", "Search the web.", {"query": TOPICS},
             ("Search the web for {query}.", "Can you look up {query}?", "Find {query} online.",
              "Search for {query}."),
             ("I found this about {query}: {result}.", "Here is what I found: {result}."),
             ("3 articles and a video", "a guide and two blog posts", "a news page",
              "a Wikipedia article", "several forum threads")),
    ToolSpec("read_file", "Read a file from disk.", {"path": FILES},
             ("Read the file {path}.", "Show me what is in {path}.", "Open {path} please.",
              "What does {path} contain?"),
             ("The file {path} contains {result}.", "{path} holds {result}."),
             ("12 lines of text", "a short list of settings", "two functions", "a table of data",
              "an empty line")),
    ToolSpec("run_command", "Run a shell command.", {"command": COMMANDS},
             ("Run {command}.", "Please run `{command}` for me.", "Execute {command}."),
             ("The command printed: {result}.", "Running {command} gave {result}."),
             ("ok", "3 files", "all tests passed", "done in 2 s", "no changes")),
    ToolSpec("send_email", "Send an email.", {"to": NAMES, "subject": WORDS},
             ("Send an email to {to} about the {subject}.", "Email {to} with subject {subject}.",
              "Write to {to} about the {subject}."),
             ("I sent the email about the {subject} to {to}.", "Done: {to} got your email."),
             ("sent", "queued", "delivered")),
    ToolSpec("calculator", "Evaluate a math expression.", {"expression": _expr},
             ("What is {expression}?", "Calculate {expression}.", "Compute {expression} please.",
              "How much is {expression}?"),
             ("{expression} is {result}.", "The result is {result}."),
             ()),
    ToolSpec("get_stock_price", "Latest price of a stock.", {"symbol": SYMBOLS},
             ("What is the price of {symbol}?", "How much is {symbol} stock today?",
              "Get me the stock price of {symbol}."),
             ("{symbol} trades at {result}.", "The price of {symbol} is {result}."),
             ("101.5 USD", "342 USD", "87.2 USD", "12.9 USD", "455 USD")),
    ToolSpec("translate", "Translate text.", {"text": PHRASES, "language": LANGUAGES},
             ("Translate '{text}' into {language}.", "How do you say {text} in {language}?"),
             ("In {language}, {text} is: {result}.", "The translation is: {result}."),
             ("bonjour", "gracias", "danke", "ciao", "obrigado", "arigato")),
    ToolSpec("get_population", "Population of a country.", {"country": COUNTRIES},
             ("What is the population of {country}?", "How many people live in {country}?"),
             ("{country} has {result} people.", "The population of {country} is {result}."),
             ("5 million", "48 million", "83 million", "125 million", "10 million")),
    ToolSpec("book_flight", "Book a flight.", {"origin": CITIES, "destination": CITIES},
             ("Book a flight from {origin} to {destination}.",
              "I need a flight from {origin} to {destination}."),
             ("Your flight from {origin} to {destination} is booked: {result}.",
              "Booked: {result}."),
             ("flight 212 at 10:40", "flight 87 at 07:15", "flight 330 at 19:05")),
    ToolSpec("get_news", "Top news headlines of a country.", {"country": COUNTRIES},
             ("What is the news in {country}?", "Any headlines from {country} today?"),
             ("The top story in {country}: {result}.", "Today in {country}: {result}."),
             ("an election", "a football final", "a new bridge", "a heat wave")),
)
_BY_NAME = {t.name: t for t in TOOLS}

NO_TOOL = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi! What can I do for you?"),
    ("Thanks!", "You are welcome."),
    ("Thank you, that is all.", "You are welcome, have a nice day."),
    ("Who are you?", "I am a small assistant that can call tools."),
    ("Tell me a joke.", "I do not know any jokes, sorry."),
    ("What can you do?", "I can answer with the help of the tools I am given."),
    ("Write a poem about the sea.", "The sea is wide and blue, and it sings all night."),
    ("How are you?", "I am fine, thank you."),
    ("Good night.", "Good night!"),
    ("What is your name?", "My name is EDMM tiny."),
    ("Can you help me?", "Yes, tell me what you need."),
)

SYSTEMS = (
    "You are a helpful assistant.", "You are a helpful assistant. Answer briefly.",
    "You are an agent. Use the tools when they help.", "Be concise.",
    "You are a friendly assistant.",
)


def _value(rng: random.Random, gen: Any) -> str:
    return gen(rng) if callable(gen) else rng.choice(gen)


def _result(rng: random.Random, spec: ToolSpec, args: dict[str, str]) -> str:
    if spec.name == "calculator":
        a, op, b = args["expression"].split()
        x, y = int(a), int(b)
        value = {"+": x + y, "-": x - y, "*": x * y, "/": round(x / y, 2)}[op]
        return str(value)
    if spec.name == "get_weather" and rng.random() < 0.3:
        return rng.choice((f"Sunny in {args['city']}, 24 C", json.dumps(
            {"temperature": rng.randint(-5, 35), "sky": rng.choice(("clear", "cloudy"))})))
    return rng.choice(spec.results)


def tool_schema(rng: random.Random, spec: ToolSpec) -> dict[str, Any]:
    """The tool as a client sends it, in one of the shapes real SDKs use."""
    style = rng.random()
    props: dict[str, Any] = {}
    for arg in spec.args:
        prop: dict[str, Any] = {"type": "string"}
        if style < 0.3:
            prop = {"title": arg.replace("_", " ").title(), "type": "string"}
        elif style < 0.5:
            prop = {"type": "string", "description": f"The {arg.replace('_', ' ')}."}
        props[arg] = prop
    params: dict[str, Any]
    if style < 0.3:  # pydantic / the Agents SDK
        params = {"properties": props, "required": list(spec.args),
                  "title": f"{spec.name}_args", "type": "object", "additionalProperties": False}
    else:
        params = {"type": "object", "properties": props}
        if rng.random() < 0.7:
            params["required"] = list(spec.args)
    fn: dict[str, Any] = {"name": spec.name}
    if rng.random() < 0.7:
        fn["description"] = spec.description
    fn["parameters"] = params
    if style < 0.3 and rng.random() < 0.5:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _call(spec: ToolSpec, args: dict[str, str], idx: int) -> dict[str, Any]:
    return {"id": f"call_{idx}", "type": "function",
            "function": {"name": spec.name, "arguments": json.dumps(args)}}


def _pick_tools(rng: random.Random, needed: list[ToolSpec],
                most_others: int = 3) -> list[dict[str, Any]]:
    others = [t for t in TOOLS if t not in needed]
    chosen = list(dict.fromkeys(needed + rng.sample(others, rng.randint(0, most_others))))
    rng.shuffle(chosen)
    return [tool_schema(rng, t) for t in chosen]


def _args(rng: random.Random, spec: ToolSpec) -> dict[str, str]:
    out = {k: _value(rng, v) for k, v in spec.args.items()}
    if spec.name == "book_flight":
        while out["destination"] == out["origin"]:
            out["destination"] = rng.choice(CITIES)
    return out


def _start(rng: random.Random, messages: list[dict[str, Any]]) -> None:
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})


def _single(rng: random.Random,
            most_others: int = 3) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = rng.choice(TOOLS)
    args = _args(rng, spec)
    messages: list[dict[str, Any]] = []
    _start(rng, messages)
    messages.append({"role": "user", "content": rng.choice(spec.questions).format(**args)})
    call = _call(spec, args, 0)
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    result = _result(rng, spec, args)
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
    answer = rng.choice(spec.answers).format(**args, result=result)
    messages.append({"role": "assistant", "content": answer})
    return _pick_tools(rng, [spec], most_others), messages


def _parallel(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if rng.random() < 0.6:
        spec = _BY_NAME[rng.choice(("get_weather", "get_time"))]
        a, b = rng.sample(CITIES, 2)
        what = "weather" if spec.name == "get_weather" else "time"
        question = rng.choice((f"What is the {what} in {a} and in {b}?",
                                  f"Compare the {what} in {a} and {b}.",
                                  f"{what} in {a} and {b}?"))
        pairs = [(spec, {"city": a}), (spec, {"city": b})]
    else:
        s1, s2 = rng.sample(TOOLS, 2)
        a1, a2 = _args(rng, s1), _args(rng, s2)
        q1 = rng.choice(s1.questions).format(**a1).rstrip("?.")
        q2 = rng.choice(s2.questions).format(**a2)
        question = f"{q1}, and {q2[0].lower()}{q2[1:]}"
        pairs = [(s1, a1), (s2, a2)]
    messages: list[dict[str, Any]] = []
    _start(rng, messages)
    messages.append({"role": "user", "content": question})
    calls = [_call(s, a, i) for i, (s, a) in enumerate(pairs)]
    messages.append({"role": "assistant", "content": "", "tool_calls": calls})
    results = [_result(rng, s, a) for s, a in pairs]
    for i, r in enumerate(results):
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": r})
    parts = [s.answers[0].format(**a, result=r).rstrip(".")
             for (s, a), r in zip(pairs, results, strict=True)]
    messages.append({"role": "assistant", "content": f"{parts[0]}, and {parts[1][0].lower()}"
                                                     f"{parts[1][1:]}."})
    return _pick_tools(rng, list(dict.fromkeys(s for s, _ in pairs))), messages


def _direct(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    question, answer = rng.choice(NO_TOOL)
    if rng.random() < 0.3:  # a question the tools cannot answer
        topic = rng.choice(("the meaning of life", "my favourite color", "the best movie",
                               "what I ate today", "my password"))
        question = rng.choice((f"What is {topic}?", f"Do you know {topic}?"))
        answer = f"I cannot tell {topic}: none of my tools can answer that."
    messages: list[dict[str, Any]] = []
    _start(rng, messages)
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    tools = _pick_tools(rng, rng.sample(TOOLS, rng.randint(1, 2))) if rng.random() < 0.7 \
        else []
    return tools, messages


def _json(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    kind = rng.randrange(4)
    if kind == 0:
        city, country = rng.choice(CITIES), rng.choice(COUNTRIES)
        q = f"{city} is a city in {country}. Return the city and country as JSON."
        obj: dict[str, Any] = {"city": city, "country": country}
    elif kind == 1:
        name, age = rng.choice(NAMES), rng.randint(5, 90)
        q = rng.choice((f"{name} is {age} years old. Give me JSON with name and age.",
                           f"Extract the person: {name}, age {age}. Answer in JSON."))
        obj = {"name": name, "age": age}
    elif kind == 2:
        city, weather = rng.choice(CITIES), rng.choice(WEATHER)
        sky, temp = weather.split(", ")
        q = f"In {city} it is {weather}. Reply with a JSON object."
        obj = {"city": city, "conditions": sky, "temperature": int(temp.split()[0])}
    else:
        word = rng.choice(WORDS)
        q = f"Summarize in JSON: the {word} is on {rng.choice(('Monday', 'Friday'))}."
        obj = {"topic": word, "summary": f"The {word} is planned."}
    messages: list[dict[str, Any]] = []
    _start(rng, messages)
    messages += [{"role": "user", "content": q},
                 {"role": "assistant", "content": json.dumps(obj)}]
    return [], messages


def conversation(rng_seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``(tools, messages)`` of conversation number ``rng_seed`` (deterministic)."""
    rng = random.Random(rng_seed)
    r = rng.random()
    if r < 0.55:
        return _single(rng)
    if r < 0.72:
        return _parallel(rng)
    if r < 0.88:
        return _direct(rng)
    return _json(rng)


def copy_conversation(rng_seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A conversation of the second training phase, short and copy-heavy: JSON extraction,
    single calls with one tool or two, else one of :func:`conversation`."""
    rng = random.Random(rng_seed)
    r = rng.random()
    if r < 0.35:
        return _json(rng)
    if r < 0.85:
        return _single(rng, most_others=1)
    return conversation(rng.randrange(2**31))


def short_copy_conversation(rng_seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A conversation of the third training phase: JSON extraction, or one call to the only
    tool of the request (the shortest prompts where the reply copies from the question)."""
    rng = random.Random(rng_seed)
    return _json(rng) if rng.random() < 0.6 else _single(rng, most_others=0)
