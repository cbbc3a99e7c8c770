"""`bulkgen bench`: one workload through bulkgen and its peers, each in its own process, one table.

Every engine generates exactly each row's max_new_tokens greedily with EOS masked, so all do the same
work and their token ids can be compared request by request. `--make-workload` writes the standard workload.
"""
