"""Structured outputs through the server on the real engine and the embedded SmolLM2-135M-Instruct, with the
official openai SDK: `chat.completions.parse(response_format=<pydantic model>)` returns a parsed object for
20 prompts and schemas (nested objects, arrays, enums, bounded numbers), json_object output always parses,
regex and choice are honoured on both routes, and a free request's text is the same with constrained
neighbours in flight."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine_args import EngineArgs
from jaxllm.server.app import build_app
from tests.server.conftest import LiveServer

Short = Field(max_length=24)


class City(BaseModel):
    name: str = Short
    country: str = Short


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Colors(BaseModel):
    colors: list[Literal["red", "green", "blue", "yellow"]] = Field(max_length=4)


class Weather(BaseModel):
    city: str = Short
    temperature_c: int = Field(ge=-50, le=60)
    sky: Literal["sunny", "cloudy", "rainy", "snowy"]


class Book(BaseModel):
    title: str = Short
    author: Person
    pages: int = Field(ge=1, le=5000)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)


class Item(BaseModel):
    name: str = Short
    price: int = Field(ge=0, le=1000)


class Order(BaseModel):
    items: list[Item] = Field(max_length=3)
    paid: bool


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Shape(BaseModel):
    kind: Literal["triangle", "square", "circle"]
    points: list[Point] = Field(max_length=4)


class Pet(BaseModel):
    species: Literal["cat", "dog", "bird", "fish"]
    name: str = Short
    legs: int = Field(ge=0, le=4)


class Movie(BaseModel):
    title: str = Short
    year: int = Field(ge=1900, le=2030)
    genres: list[Literal["drama", "comedy", "action", "horror"]] = Field(max_length=2)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]


class Planet(BaseModel):
    name: str = Short
    moons: int = Field(ge=0, le=200)
    has_rings: bool


class Recipe(BaseModel):
    dish: str = Short
    ingredients: list[str] = Field(max_length=3)
    minutes: int = Field(ge=1, le=600)


class Team(BaseModel):
    leader: Person
    members: list[Person] = Field(max_length=2)


class Translation(BaseModel):
    source: Literal["en", "fr", "de"]
    target: Literal["en", "fr", "de"]
    text: str = Short


class Meeting(BaseModel):
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    hour: int = Field(ge=0, le=23)
    attendees: list[str] = Field(max_length=3)


class Score(BaseModel):
    home: int = Field(ge=0, le=20)
    away: int = Field(ge=0, le=20)
    winner: Literal["home", "away", "draw"]


class Address(BaseModel):
    street: str = Short
    city: City
    zip: str = Field(pattern=r"^[0-9]{5}$")


CASES = [
    ("What is the capital of France? Answer as JSON.", City),
    ("Invent a person. Answer as JSON.", Person),
    ("Name some colors of the rainbow as JSON.", Colors),
    ("Describe the weather in London as JSON.", Weather),
    ("Describe a famous book as JSON.", Book),
    ("Is the sky blue? Answer as JSON.", Answer),
    ("Order two pizzas as JSON.", Order),
    ("Describe a triangle as JSON.", Shape),
    ("Describe a pet as JSON.", Pet),
    ("Describe a movie as JSON.", Movie),
    ("What is the sentiment of 'I love it'? Answer as JSON.", Sentiment),
    ("Describe Saturn as JSON.", Planet),
    ("Give a pancake recipe as JSON.", Recipe),
    ("Describe a team of three people as JSON.", Team),
    ("Translate 'hello' to French as JSON.", Translation),
    ("Schedule a meeting as JSON.", Meeting),
    ("Give a football score as JSON.", Score),
    ("Give an address in Paris as JSON.", Address),
    ("Describe Mars as JSON.", Planet),
    ("Invent an old person as JSON.", Person),
]


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024)
    with LiveServer(build_app(AsyncLLMEngine.from_engine_args(args), disconnect_poll_s=0.05)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", timeout=900)


def test_parse_returns_an_object_for_20_schemas(client):
    model = client.models.list().data[0].id

    def ask(case):
        prompt, fmt = case
        r = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=fmt,
            temperature=0,
            max_tokens=300,
        )
        return r.choices[0]

    with ThreadPoolExecutor(len(CASES)) as pool:
        choices = list(pool.map(ask, CASES))
    for (prompt, fmt), choice in zip(CASES, choices):
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        parsed = choice.message.parsed
        assert isinstance(parsed, fmt), (prompt, choice.message.content)
        assert fmt.model_validate_json(choice.message.content) == parsed


def test_json_object_regex_and_choice(client):
    model = client.models.list().data[0].id

    def json_object(i: int):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Give me a JSON object about animal number {i}."}],
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=i,
            max_tokens=150,
        )

    def regex():
        return client.completions.create(
            model=model, prompt="My phone number is", max_tokens=20, temperature=0.8, seed=1,
            extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}},
        )  # fmt: skip

    def choice():
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Is water wet?"}],
            max_tokens=10,
            extra_body={"guided_choice": ["yes", "no", "maybe"]},
        )

    with ThreadPoolExecutor(5) as pool:  # one batch, each row under its own grammar
        objects = [pool.submit(json_object, i) for i in range(3)]
        phone, answer = pool.submit(regex), pool.submit(choice)
        for f in objects:
            r = f.result()
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(r.choices[0].message.content), dict)
            else:  # cut by max_tokens: a prefix of an object
                assert r.choices[0].message.content.startswith("{")
        assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", phone.result().choices[0].text)
        assert answer.result().choices[0].message.content in ("yes", "no", "maybe")


def test_free_request_unchanged_beside_constrained_ones(client):
    model = client.models.list().data[0].id
    free = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}

    def constrained(i):
        return client.completions.create(
            model=model, prompt=f"Number {i}:", max_tokens=24, temperature=0.9, seed=i,
            extra_body={"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
        )  # fmt: skip

    alone = client.completions.create(**free).choices[0].text
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(constrained, i) for i in range(8)]
        beside = pool.submit(lambda: client.completions.create(**free)).result().choices[0].text
        for f in others:
            f.result()
    assert beside == alone


def test_an_invalid_grammar_is_a_400_and_the_server_keeps_serving(client):
    import openai

    model = client.models.list().data[0].id
    for extra in ({"structured_outputs": {"regex": "[a-z"}}, {"guided_grammar": "root ::= undefined_rule"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="Hi", max_tokens=4, extra_body=extra)
        assert e.value.status_code == 400 and "structured_outputs" in e.value.message
    r = client.completions.create(
        model=model, prompt="Hi", max_tokens=4, extra_body={"guided_choice": ["a", "b"]}
    )
    assert r.choices[0].text in ("a", "b")
