# One image for every service; the command picks the service.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml ./
COPY infermesh infermesh
COPY shared shared
COPY services services
COPY kernels kernels
COPY loadtests loadtests
COPY migrations migrations
RUN pip install --no-cache-dir -e ".[vllm]" \
 && pip uninstall -y torchvision torchaudio torchcodec triton || true \
 && python -c "from infermesh.models import prepare_gemma; prepare_gemma('/models')"
ENV HF_HUB_OFFLINE=1
CMD ["python", "-m", "services.edge", "--host", "0.0.0.0"]
