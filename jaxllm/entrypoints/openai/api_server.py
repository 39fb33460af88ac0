"""`python -m jaxllm.entrypoints.openai.api_server --model MODEL` (vLLM's module path): calls server.cli."""

from jaxllm.server.cli import api_server_main

if __name__ == "__main__":
    api_server_main()
