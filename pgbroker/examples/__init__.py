"""Small applications built on pgbroker, kept in the package and tested end to end (tests/test_example_websocket.py).

- :mod:`pgbroker.examples.websocket_broker`: a websocket server that pushes row changes to its clients, one active
  instance at a time (``python -m pgbroker.examples.websocket_broker``; needs the ``examples`` extra).
"""
