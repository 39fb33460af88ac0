# Sourced by the H200 server scripts: installs the wheels carried in .whl (starlette, uvicorn, uvloop -
# a dependency of jaxllm's, so the server runs on the event loop users get - and a
# transformers >= 5.18 with its huggingface_hub and tokenizers, which pyproject asks for) into /tmp/site
# and puts it first on PYTHONPATH. The image's transformers 5.17 imports torch with the tokenizer class
# (6 s of a server's start there); a user installing jaxllm gets the newer release. If the carried
# transformers does not import on the image, it is removed again and the image's is used, and the
# script says so. Needs $PY.
install_carried_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "cannot install the wheels in .whl"; return 1; }
  fi
  export PYTHONPATH="/tmp/site:$PWD"
  if ! "$PY" -c 'import transformers' 2>/dev/null; then
    echo "the carried transformers does not import here; using the image's"
    rm -rf /tmp/site/transformers* /tmp/site/huggingface_hub* /tmp/site/tokenizers*
  fi
  "$PY" -c 'import starlette, uvicorn' 2>/dev/null || { echo "starlette/uvicorn missing (carry .whl)"; return 1; }
  "$PY" -c 'import sys, transformers; from transformers import PreTrainedTokenizerFast
print("transformers", transformers.__version__, "- the tokenizer class imports torch:", "torch" in sys.modules)'
}
