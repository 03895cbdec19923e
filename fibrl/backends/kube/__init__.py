"""The kubernetes backend's pieces; :mod:`fibrl.backends.kubernetes` assembles them.

Split along the policy/mechanism line:

* ``settings``  -- config keys parsed into one frozen object; names, labels,
  quantities; where this process runs (a pod or not);
* ``manifests`` -- the Secret, worker Pod and launcher Job fibrl sends (pure dicts);
* ``api``       -- the official client: connecting, retries with backoff on
  429/5xx, and errors that name the fix;
* ``watch``     -- one list+watch of a run's pods, resyncing with backoff;
* ``job``       -- one worker pod as a Job: what its status means (exit code,
  failure reason) and its state machine;
* ``creator``   -- pod creation in bounded waves.

None of these modules is imported by ``import fibrl``; they import the
``kubernetes`` package themselves, inside functions, when first used.
"""
