# Image targets only (see docker/build-image.sh --help).
# IMAGE empty: tags fibrl:latest (the config default) and fibrl:<version> (what
# kubernetes pods of the default image run).
IMAGE ?=
EXTRAS ?= rl,docker,kubernetes,tls

.PHONY: image image-offline base-image wheels

# Worker image, pulling python:3.11-slim and installing from PyPI.
image:
	IMAGE_EXTRAS='$(EXTRAS)' docker/build-image.sh $(if $(strip $(IMAGE)),--tag '$(strip $(IMAGE))')

# Worker image without a registry: debootstrapped base + host-built wheels.
image-offline:
	IMAGE_EXTRAS='$(EXTRAS)' docker/build-image.sh --offline $(if $(strip $(IMAGE)),--tag '$(strip $(IMAGE))')

base-image:
	docker/build-base.sh

wheels:
	IMAGE_EXTRAS='$(EXTRAS)' docker/build-wheels.sh
