/* activation_guard HTML report: sortable, filterable tables. The page works without this script
   (every row is in the HTML); the script only adds sorting, filtering and revealing anchors. */
(function () {
  "use strict";

  function globToRegExp(q) {
    var re = "";
    for (var i = 0; i < q.length; i++) {
      var c = q.charAt(i);
      if (c === "*") re += ".*";
      else if (c === "?") re += ".";
      else re += c.replace(/[\\^$.+()|{}\[\]]/g, "\\$&");
    }
    return new RegExp("^" + re + "$", "i");
  }

  function sortKey(row, col, numeric) {
    var td = row.cells[col];
    if (!td) return null;
    var v = td.hasAttribute("data-v") ? td.getAttribute("data-v") : td.textContent;
    if (numeric) {
      if (v === "" || v === "-") return null;
      var x = Number(v);
      return isNaN(x) ? Infinity : x; /* NaN sorts with the worst */
    }
    return v.toLowerCase();
  }

  function Table(table, tools) {
    this.table = table;
    this.body = table.tBodies[0];
    this.rows = Array.prototype.slice.call(this.body.rows);
    for (var i = 0; i < this.rows.length; i++) this.rows[i].agIndex = i;
    this.query = tools ? tools.querySelector("input[type=search]") : null;
    this.onlyBad = tools ? tools.querySelector("input.only-bad") : null;
    this.count = tools ? tools.querySelector(".count") : null;
    this.noun = table.getAttribute("data-noun") || "rows";
    var self = this;
    var heads = table.tHead ? table.tHead.rows[0].cells : [];
    Array.prototype.forEach.call(heads, function (th, col) {
      var button = th.querySelector("button");
      if (button) button.addEventListener("click", function () { self.sort(th, col); });
    });
    if (this.query) this.query.addEventListener("input", function () { self.filter(); });
    if (this.onlyBad) this.onlyBad.addEventListener("change", function () { self.filter(); });
    if (tools) tools.hidden = false;
    this.filter();
  }

  Table.prototype.sort = function (th, col) {
    var numeric = th.getAttribute("data-type") === "num";
    var current = th.getAttribute("aria-sort");
    var first = th.getAttribute("data-first") === "descending" ? "descending" : "ascending";
    var order = current === first ? (first === "ascending" ? "descending" : "ascending") : first;
    var dir = order === "ascending" ? 1 : -1;
    Array.prototype.forEach.call(th.parentNode.cells, function (c) {
      if (c.querySelector("button")) c.setAttribute("aria-sort", "none");
    });
    th.setAttribute("aria-sort", order);
    var keys = this.rows.map(function (r) { return sortKey(r, col, numeric); });
    var idx = this.rows.map(function (_, i) { return i; });
    idx.sort(function (a, b) {
      var ka = keys[a], kb = keys[b];
      if (ka === null || kb === null) {
        if (ka !== kb) return ka === null ? 1 : -1; /* no value: last, either way */
      } else if (ka < kb) return -dir;
      else if (ka > kb) return dir;
      return a - b; /* ties keep the execution order */
    });
    var rows = this.rows;
    this.rows = idx.map(function (i) { return rows[i]; });
    var frag = document.createDocumentFragment();
    this.rows.forEach(function (r) { frag.appendChild(r); });
    this.body.appendChild(frag);
  };

  Table.prototype.filter = function () {
    var q = this.query ? this.query.value.trim() : "";
    var onlyBad = this.onlyBad ? this.onlyBad.checked : false;
    var glob = /[*?]/.test(q) ? globToRegExp(q) : null;
    var needle = q.toLowerCase();
    var shown = 0;
    this.rows.forEach(function (r) {
      var name = r.getAttribute("data-name") || "";
      var keep = (!onlyBad || r.getAttribute("data-bad") === "1") &&
        (!q || (glob ? glob.test(name) : name.toLowerCase().indexOf(needle) >= 0));
      r.hidden = !keep;
      if (keep) shown++;
    });
    if (this.count) {
      this.count.textContent = shown === this.rows.length ?
        "all " + this.rows.length + " " + this.noun :
        "showing " + shown + " of " + this.rows.length + " " + this.noun;
    }
  };

  Table.prototype.reveal = function (row) {
    if (!row.hidden) return;
    if (this.query) this.query.value = "";
    this.filter();
    if (row.hidden && this.onlyBad) {
      this.onlyBad.checked = false;
      this.filter();
    }
  };

  var tables = [];
  Array.prototype.forEach.call(document.querySelectorAll("table.ag"), function (table) {
    var box = table.closest(".table-box");
    var t = new Table(table, box ? box.querySelector(".tools") : null);
    table.agTable = t;
    tables.push(t);
  });

  function reveal(id) {
    var el = id ? document.getElementById(id) : null;
    if (!el) return;
    for (var p = el.parentElement; p; p = p.parentElement) {
      if (p.tagName === "DETAILS") p.open = true;
    }
    var table = el.closest("table.ag");
    if (table && table.agTable) table.agTable.reveal(el);
  }

  document.addEventListener("click", function (e) {
    var row = e.target.closest ? e.target.closest("tr[data-heat]") : null;
    if (row) {  // a diverged row with a heatmap: show it, hide the section's others
      var fig = document.querySelector('figure.heat[data-fig="' + row.getAttribute("data-heat") + '"]');
      if (fig) {
        var box = fig.parentElement;
        Array.prototype.forEach.call(box.querySelectorAll("figure.heat"), function (f) { f.hidden = f !== fig; });
        fig.scrollIntoView({block: "nearest"});
      }
    }
    var a = e.target.closest ? e.target.closest("a[href^='#']") : null;
    if (a) reveal(decodeURIComponent(a.getAttribute("href").slice(1)));
  });
  window.addEventListener("hashchange", function () { reveal(decodeURIComponent(location.hash.slice(1))); });
  if (location.hash) {
    reveal(decodeURIComponent(location.hash.slice(1)));
    var target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target) target.scrollIntoView({block: "center"});
  }
  window.agReport = {tables: tables};
})();
