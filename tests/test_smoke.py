def test_claim_unqualified(connect):
    a = connect("A")
    assert a.execute("SELECT broker_claim()").fetchone()[0] == 1
