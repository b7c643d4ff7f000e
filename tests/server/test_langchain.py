"""LangChain's ChatOpenAI against the server: bind_tools with a forced tool and
with_structured_output with a pydantic model."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Weather(BaseModel):
    """Get the weather in a city."""

    city: str = Field(max_length=24)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Answer(BaseModel):
    answer: str = Field(max_length=40)
    confidence: int = Field(ge=0, le=100)


def chat(server, model_name):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=model_name,
                                       temperature=0, max_tokens=80, max_retries=0)


def test_bind_tools(server, model_name):
    llm = chat(server, model_name).bind_tools([Weather], tool_choice="Weather")
    msg = llm.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    Weather(**msg.tool_calls[0]["args"])   # the arguments validate against the tool's schema


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(server, model_name, method):
    llm = chat(server, model_name).with_structured_output(Answer, method=method)
    out = llm.invoke("What is the capital of France? Answer with your confidence.")
    assert isinstance(out, Answer) and out.answer
