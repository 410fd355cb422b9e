# Release artefacts (issue 43): `python -m build` makes the sdist and the wheel, `twine check` holds their
# metadata (README rendering, classifiers) to what an index accepts. Both tools go into the main venv here,
# so CI (TEST_DEPS) runs this with `make test`. The artefacts land in dist/ (untracked).

RELEASE_STAMP := $(VENV)/.release-tools-v1
RELEASE_TOOLS := 'build>=1.2' 'twine>=5'
DIST := dist

TEST_DEPS += release-check

.PHONY: release-tools release-check

release-tools: $(RELEASE_STAMP)

$(RELEASE_STAMP): mk/release.mk $(STAMP)
	$(BIN)/pip install -q $(RELEASE_TOOLS)
	touch $(RELEASE_STAMP)

release-check: release-tools
	rm -rf $(DIST)
	$(BIN)/python -m build --outdir $(DIST) .
	$(BIN)/twine check --strict $(DIST)/*
