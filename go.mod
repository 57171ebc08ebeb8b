module github.com/dedupkit/dedup

go 1.26
