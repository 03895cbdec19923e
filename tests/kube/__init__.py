"""Kubernetes test support for fibrl: a fake API server that really runs pods.

* :mod:`tests.kube.fake_apiserver` -- ``FakeApiServer`` (start/stop, kubeconfig, test hooks);
* :mod:`tests.kube.conftest_plugin` -- pytest fixtures around it;
* ``fixtures/`` -- hand-written responses in the real API's shape, which
  ``tests/unit/test_fake_apiserver.py`` compares the fake against.
"""
