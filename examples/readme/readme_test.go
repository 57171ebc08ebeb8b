package readme

import (
	"os"
	"strings"
	"testing"
)

// goBlocks returns the fenced Go blocks of a Markdown document.
func goBlocks(md string) []string {
	var blocks []string
	var cur []string
	in := false
	for _, line := range strings.Split(md, "\n") {
		switch {
		case !in && strings.TrimSpace(line) == "```go":
			in, cur = true, nil
		case in && strings.TrimSpace(line) == "```":
			in = false
			blocks = append(blocks, strings.Join(cur, "\n"))
		case in:
			cur = append(cur, line)
		}
	}
	return blocks
}

// TestREADMESnippetsCompile: every Go block of README.md appears, line for
// line, in readme.go, one tab in (inside a function), so the build checks
// it. A block changed or added in the README without its copy here fails.
func TestREADMESnippetsCompile(t *testing.T) {
	md, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("readme.go")
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlocks(string(md))
	if len(blocks) == 0 {
		t.Fatal("no ```go block found in README.md")
	}
	for i, b := range blocks {
		lines := strings.Split(b, "\n")
		for j, l := range lines {
			if l != "" {
				lines[j] = "\t" + l
			}
		}
		if !strings.Contains(string(src), strings.Join(lines, "\n")) {
			t.Errorf("README.md's Go block %d is not in examples/readme/readme.go (put it there, one tab in, inside a function that declares what it uses, so that it is compiled):\n%s", i+1, b)
		}
	}
}

func TestGoBlocks(t *testing.T) {
	got := goBlocks("text\n```go\na := 1\n\nb()\n```\n```sh\nls\n```\n  ```go\nc()\n  ```\n")
	if len(got) != 2 || got[0] != "a := 1\n\nb()" || got[1] != "c()" {
		t.Errorf("goBlocks = %q", got)
	}
}
