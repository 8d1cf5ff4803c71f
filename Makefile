# C users' entry points. The build itself is cargo's; this file only names the usual targets.
#
#   make                      build the libraries (release)
#   make install PREFIX=DIR   install libgscomm.so/.a, gsc.h, gsc_device.cuh, gscomm.pc
#   make uninstall PREFIX=DIR
#   make check                the test suite (cargo test)
#
# DESTDIR is honoured for staged installs (packagers), LIBDIR and INCLUDEDIR can be overridden.

PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
CARGO ?= cargo
# Where cargo puts what it builds (cargo's own CARGO_TARGET_DIR, when set, else target/).
CARGO_TARGET_DIR ?= target

.PHONY: all build install uninstall check

all: build

build:
	$(CARGO) build --release -p gscomm --lib

install: build
	scripts/install.sh --prefix "$(PREFIX)" --libdir "$(LIBDIR)" --includedir "$(INCLUDEDIR)" \
		--from "$(CARGO_TARGET_DIR)/release" --destdir "$(DESTDIR)"

uninstall:
	rm -f "$(DESTDIR)$(LIBDIR)"/libgscomm.so "$(DESTDIR)$(LIBDIR)"/libgscomm.so.* \
		"$(DESTDIR)$(LIBDIR)"/libgscomm.a "$(DESTDIR)$(LIBDIR)"/pkgconfig/gscomm.pc \
		"$(DESTDIR)$(INCLUDEDIR)"/gsc.h "$(DESTDIR)$(INCLUDEDIR)"/gsc_device.cuh

check:
	$(CARGO) test
