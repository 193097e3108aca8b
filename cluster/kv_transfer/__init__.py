"""kv_transfer"""
