#!/usr/bin/env bash
# Stage, here, the peer sources the GPU machine cannot download: llm.c and cuDNN's frontend headers (which
# llm.c's `USE_CUDNN=1` build includes), into .peers/ (ignored by git; ~5 MB), from local git clones or mirrors:
#
#   LLMC_GIT=path/to/llm.c/.git CUDNN_FRONTEND_GIT=path/to/cudnn-frontend/.git bash bench/gpu_peers.sh
#
# Carry `.peers` with the call; `bash bench/gpu.sh train` builds train_gpt2cu there (a minute or two of nvcc)
# unless LLMC names a binary already built.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLMC_GIT:?the git directory of an llm.c clone}" "${CUDNN_FRONTEND_GIT:?the git directory of a cudnn-frontend clone}"
rm -rf .peers && mkdir -p .peers/llm.c .peers/cudnn-frontend
git --git-dir "$LLMC_GIT" archive HEAD | tar -x -C .peers/llm.c
git --git-dir "$CUDNN_FRONTEND_GIT" archive HEAD include | tar -x -C .peers/cudnn-frontend
{ echo "llm.c $(git --git-dir "$LLMC_GIT" log -1 --format='%h %cd')"
  echo "cudnn-frontend $(git --git-dir "$CUDNN_FRONTEND_GIT" log -1 --format='%h %cd')"; } | tee .peers/VERSIONS
du -sh .peers
